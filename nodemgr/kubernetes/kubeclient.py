"""The official kubernetes client, imported slim, and the requests gpushare makes with it.

The one module that imports the ``kubernetes`` package (an import contract
says so). It keeps what the official client is trusted for: ``Configuration``
(address, TLS, bearer token, and the ``refresh_api_key_hook`` through which
exec plugins, OIDC and the in-cluster loader renew credentials: asked at most
once a second and after a 401, ``KubeClient.credentials``), the kubeconfig
and in-cluster loaders, and ``rest.RESTClientObject``
(the urllib3 pool with that TLS and proxy setup). It leaves out what the
daemon never uses and pays for in memory:

- the generated API classes: ``CoreV1Api`` alone imports ~250 pydantic
  models at import (~21 MiB); ``CoreV1`` and ``AuthorizationV1`` below make
  the few requests gpushare makes, under the generated methods' names and
  arguments, and hand back the raw response (every caller parses the JSON
  itself, as with ``_preload_content=False``);
- the generated ``ApiClient``: it imports pydantic, python-dateutil and
  multiprocessing for model (de)serialisation and async requests (~9 MiB);
  ``KubeClient.request`` does the part we use (headers, credentials from the
  Configuration, the URL, errors as ``ApiException``);
- the package ``kubernetes/__init__.py``, which imports every subpackage
  (dynamic, watch, stream with websocket-client, leaderelection, informer).

How (``_import_slim``, only when nothing imported ``kubernetes`` before): the
``kubernetes`` package is registered without running its ``__init__`` (the
real ``__path__``, so submodules import as usual, and the subpackages the
real ``__init__`` names are imported on first attribute access, so any other
importer in the process still finds them). ``kubernetes.client`` is the real
package: since version 37 its ``__init__`` exports the API classes and models
lazily (PEP 562). Only ``kube_config`` needs care: it binds
``kubernetes.client.ApiClient`` at import (for ``new_client_from_config`` and
the OIDC refresh, neither used here), which would import the generated
``ApiClient``; while it is imported that name is a function that builds the
real ``ApiClient`` when called, then the name is removed again so everyone
else gets the real class.

What would break it: a kubernetes release that changes the names or
signatures used here (``Configuration.auth_settings``,
``RESTClientObject.request``, ``ApiException.from_response``, the loaders),
makes ``kubernetes.client`` import eagerly again, or adds a subpackage to the
top ``__init__``. tests/unit/kubernetes/test_kubeclient.py fails loudly on
each of these; run it after any upgrade of the ``kubernetes`` dependency.

What it must not do: import the generated API classes or models, or be
imported anywhere but nodemgr.kubernetes (it is the client).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote, urlencode

# The subpackages that kubernetes/__init__.py imports (`from . import X`).
SUBPACKAGES = (
    "client",
    "config",
    "dynamic",
    "watch",
    "stream",
    "utils",
    "leaderelection",
    "informer",
)


def _api_client_on_first_use(*args: Any, **kwargs: Any) -> Any:
    """What kube_config calls ``ApiClient``: the generated one, imported only if ever called."""
    from kubernetes.client.api_client import ApiClient

    return ApiClient(*args, **kwargs)


def _import_slim() -> None:
    """Import the parts of ``kubernetes`` used here without the package ``__init__`` (above)."""
    if "kubernetes" in sys.modules:
        return  # already imported by someone (a test, a tool): nothing left to save
    spec = importlib.util.find_spec("kubernetes")
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
        raise ImportError("the kubernetes client is not installed (pip install kubernetes)")
    package = importlib.util.module_from_spec(spec)  # __path__ and __spec__, not executed
    with open(spec.origin, encoding="utf-8") as f:
        version = re.search(r'^__version__ = "([^"]+)"', f.read(), re.MULTILINE)
    if version is not None:
        package.__dict__["__version__"] = version.group(1)

    def subpackage(name: str) -> Any:
        if name in SUBPACKAGES:
            return importlib.import_module(f"kubernetes.{name}")
        raise AttributeError(f"module 'kubernetes' has no attribute {name!r}")

    package.__dict__["__getattr__"] = subpackage
    sys.modules["kubernetes"] = package
    try:
        client = importlib.import_module("kubernetes.client")
        client.__dict__["ApiClient"] = _api_client_on_first_use
        try:
            importlib.import_module("kubernetes.config")
        finally:
            del client.__dict__["ApiClient"]
    except BaseException:
        # Nothing half-made stays behind: a later import starts over.
        for name in [m for m in sys.modules if m == "kubernetes" or m.startswith("kubernetes.")]:
            del sys.modules[name]
        raise


_import_slim()

from kubernetes.client.configuration import Configuration  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402
from kubernetes.client.rest import RESTClientObject  # noqa: E402
from kubernetes.config.config_exception import ConfigException  # noqa: E402
from kubernetes.config.incluster_config import InClusterConfigLoader  # noqa: E402
from kubernetes.config.kube_config import load_kube_config  # noqa: E402
from kubernetes.utils.quantity import parse_quantity  # noqa: E402

__all__ = [
    "ApiException",
    "AuthorizationV1",
    "ConfigException",
    "Configuration",
    "CoreV1",
    "InClusterConfigLoader",
    "KubeClient",
    "RESTClientObject",
    "ResourceV1",
    "load_kube_config",
    "parse_quantity",
]

# How long the credentials the Configuration gave are sent before it is asked again
# (KubeClient.credentials).
CREDENTIALS_SECONDS = 1.0

JSON = "application/json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"

# The query parameters of a LIST or WATCH: the generated methods' argument -> the API's name.
LIST_QUERY = {
    "allow_watch_bookmarks": "allowWatchBookmarks",
    "_continue": "continue",
    "field_selector": "fieldSelector",
    "label_selector": "labelSelector",
    "limit": "limit",
    "resource_version": "resourceVersion",
    "timeout_seconds": "timeoutSeconds",
    "watch": "watch",
}


class KubeClient:
    """What the generated ``ApiClient`` did for gpushare: one request, its raw response.

    ``configuration``: ours alone (never the client's global default);
    ``rest_client``: the official urllib3 pool built from it.
    """

    def __init__(self, configuration: Configuration, clock: Callable[[], float] = time.monotonic):
        self.configuration = configuration
        self.rest_client = RESTClientObject(configuration)
        self.user_agent = "gpushare-node"
        self._clock = clock
        # (until when, the credentials header or None): what the Configuration said last.
        self._credentials: tuple[float, tuple[str, str] | None] | None = None

    def request(
        self,
        method: str,
        path: str,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str | None = None,
        timeout: float | tuple[float, float] | None = None,
    ) -> Any:
        """``method`` on ``path`` (already quoted); the urllib3 response, its body unread.

        The credentials come from the Configuration (``credentials``), so a
        token an exec plugin or the in-cluster loader renewed is used within
        ``CREDENTIALS_SECONDS``, and at the next request after a 401.
        An answer other than 2xx raises ``ApiException`` (with the body read),
        as the generated client does; so does a TLS failure (status 0).
        """
        headers = {"Accept": JSON, "User-Agent": self.user_agent}
        if body is not None:
            headers["Content-Type"] = content_type or JSON
        credentials = self.credentials()
        if credentials is not None:
            headers[credentials[0]] = credentials[1]
        url = self.configuration.host + path
        if query:
            url += "?" + urlencode([(k, _query_text(v)) for k, v in query.items()], quote_via=quote)
        response = self.rest_client.request(
            method, url, headers=headers, body=body, _request_timeout=timeout
        )
        if not 200 <= response.status <= 299:
            if response.status == 401:  # the credentials were refused: ask again next time
                self._credentials = None
            response.read()
            raise ApiException.from_response(http_resp=response, body=None, data=None)
        return response.response

    def credentials(self) -> tuple[str, str] | None:
        """The credentials header (name, value), or None: what the Configuration's
        ``auth_settings`` says, asked at most once per ``CREDENTIALS_SECONDS``.

        Asking runs the loader's ``refresh_api_key_hook``, which renews a token that
        is due and, for a kubeconfig, sets the whole configuration again (host, TLS
        files, the proxy from the environment): tens of microseconds, more than the
        rest of a request's own work. Both loaders renew well before a token expires
        (exec plugins and OIDC five minutes before, the in-cluster token file is read
        again every minute), so a header a second old is one they would still send.
        """
        now = self._clock()
        known = self._credentials
        if known is not None and now < known[0]:
            return known[1]
        # The generated methods all name the one scheme "BearerToken" (a header).
        bearer = self.configuration.auth_settings().get("BearerToken")
        header = (bearer["key"], bearer["value"]) if bearer and bearer["value"] else None
        self._credentials = (now + CREDENTIALS_SECONDS, header)
        return header

    def close(self) -> None:
        self.rest_client.pool_manager.clear()


def _query_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"  # what the API expects (Python says True)
    return str(value)


def _name(value: str) -> str:
    """A path segment: every character but letters, digits and ``_.-~`` quoted."""
    return quote(str(value), safe="")


class _Api:
    """The generated classes' calling convention, raw responses only."""

    def __init__(self, api_client: KubeClient):
        self.api_client = api_client

    def _send(
        self,
        method: str,
        path: str,
        options: dict[str, Any],
        body: Any = None,
        query_names: Mapping[str, str] | None = None,
    ) -> Any:
        if options.pop("_preload_content", False):
            raise TypeError(
                "the generated models are not loaded (nodemgr.kubernetes.kubeclient): "
                "pass _preload_content=False and parse the JSON response"
            )
        timeout = options.pop("_request_timeout", None)
        content_type = options.pop("_content_type", None)
        if body is not None and content_type is None and method == "PATCH":
            # As the official client: a JSON patch for a list, else a strategic merge.
            content_type = JSON_PATCH if isinstance(body, list) else STRATEGIC_MERGE_PATCH
        names = query_names or {}
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"{method} {path}: unsupported arguments {', '.join(unknown)}")
        query = {names[k]: v for k, v in options.items() if v is not None}
        return self.api_client.request(method, path, query, body, content_type, timeout)


class CoreV1(_Api):
    """The core/v1 requests of gpushare, as ``CoreV1Api``'s methods of the same names."""

    def list_pod_for_all_namespaces(self, **options: Any) -> Any:
        return self._send("GET", "/api/v1/pods", options, query_names=LIST_QUERY)

    def list_node(self, **options: Any) -> Any:
        return self._send("GET", "/api/v1/nodes", options, query_names=LIST_QUERY)

    def read_node(self, name: str, **options: Any) -> Any:
        return self._send("GET", f"/api/v1/nodes/{_name(name)}", options)

    def patch_node(self, name: str, body: Any, **options: Any) -> Any:
        return self._send("PATCH", f"/api/v1/nodes/{_name(name)}", options, body)

    def patch_node_status(self, name: str, body: Any, **options: Any) -> Any:
        return self._send("PATCH", f"/api/v1/nodes/{_name(name)}/status", options, body)

    def patch_namespaced_pod(self, name: str, namespace: str, body: Any, **options: Any) -> Any:
        path = f"/api/v1/namespaces/{_name(namespace)}/pods/{_name(name)}"
        return self._send("PATCH", path, options, body)

    def create_namespaced_pod_binding(
        self, name: str, namespace: str, body: Any, **options: Any
    ) -> Any:
        path = f"/api/v1/namespaces/{_name(namespace)}/pods/{_name(name)}/binding"
        return self._send("POST", path, options, body)

    def create_namespaced_event(self, namespace: str, body: Any, **options: Any) -> Any:
        return self._send("POST", f"/api/v1/namespaces/{_name(namespace)}/events", options, body)

    def patch_namespaced_event(self, name: str, namespace: str, body: Any, **options: Any) -> Any:
        path = f"/api/v1/namespaces/{_name(namespace)}/events/{_name(name)}"
        return self._send("PATCH", path, options, body)


class ResourceV1(_Api):
    """The resource.k8s.io/v1 (DRA) requests of gpushare-node, as ``ResourceV1Api``'s
    methods of the same names: its claims read and their status written, its node's
    ResourceSlice kept."""

    _BASE = "/apis/resource.k8s.io/v1"

    def read_namespaced_resource_claim(self, name: str, namespace: str, **options: Any) -> Any:
        path = f"{self._BASE}/namespaces/{_name(namespace)}/resourceclaims/{_name(name)}"
        return self._send("GET", path, options)

    def replace_namespaced_resource_claim_status(
        self, name: str, namespace: str, body: Any, **options: Any
    ) -> Any:
        path = f"{self._BASE}/namespaces/{_name(namespace)}/resourceclaims/{_name(name)}/status"
        return self._send("PUT", path, options, body)

    def list_resource_slice(self, **options: Any) -> Any:
        return self._send("GET", f"{self._BASE}/resourceslices", options, query_names=LIST_QUERY)

    def read_resource_slice(self, name: str, **options: Any) -> Any:
        return self._send("GET", f"{self._BASE}/resourceslices/{_name(name)}", options)

    def create_resource_slice(self, body: Any, **options: Any) -> Any:
        return self._send("POST", f"{self._BASE}/resourceslices", options, body)

    def replace_resource_slice(self, name: str, body: Any, **options: Any) -> Any:
        return self._send("PUT", f"{self._BASE}/resourceslices/{_name(name)}", options, body)

    def delete_resource_slice(self, name: str, **options: Any) -> Any:
        return self._send("DELETE", f"{self._BASE}/resourceslices/{_name(name)}", options)


class AuthorizationV1(_Api):
    """The authorization.k8s.io/v1 request of ``nodemgr doctor``, as ``AuthorizationV1Api``'s."""

    def create_self_subject_access_review(self, body: Any, **options: Any) -> Any:
        path = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
        return self._send("POST", path, options, body)
