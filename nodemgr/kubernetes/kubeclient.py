"""The official kubernetes client, through its public API, and the requests gpushare makes.

Importing this module loads nothing of the package; the first client, credentials or
quantity does. The package's ``__init__`` then imports all its subpackages and the
generated ``ApiClient`` with pydantic (the supported way to load it): ~15 MiB in the
daemon.

Used, all public: ``Configuration`` (credentials renewed through its
``refresh_api_key_hook``), ``kubernetes.config``'s loaders, ``ApiClient.param_serialize``
(with ``_request_auth``, the generated methods' per-request credentials) and ``call_api``
(what the library's own ``DynamicClient`` requests with), ``ApiException``,
``kubernetes.utils.parse_quantity``.

Credentials are asked of the Configuration at most once per ``CREDENTIALS_SECONDS`` and
again at once after a 401, not at every request: the kubeconfig loader's hook sets the
whole configuration again at each call (~50 us, on every claim read of a
NodePrepareResources).

Not the generated API classes: they cost ~25 MiB at import, and from release 37 they
validate a body against the client's model with unknown fields forbidden, so a
ResourceClaim showing a field newer than the client could not be written back (status
is replaced whole). ``CoreV1``, ``ResourceV1`` and ``AuthorizationV1`` below make the
few requests needed under the generated methods' names, the JSON body as given and the
raw response handed back.

``kubernetes>=37`` (pyproject.toml): ``param_serialize`` and ``call_api`` as used here
came with 37's generator. A newer release that changes them fails
tests/unit/kubernetes/test_kubeclient.py, which makes every request kind through the
installed client.

What it must not do: import the kubernetes package at module import, import
the generated API classes, or be imported anywhere but nodemgr.kubernetes (it
is the client).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubernetes.client import ApiException, Configuration

JSON = "application/json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
AUTH_SETTINGS = ["BearerToken"]  # the one scheme the generated methods name
# How long the credentials the Configuration gave are sent before it is asked again.
CREDENTIALS_SECONDS = 1.0

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


def new_configuration() -> Configuration:
    """Never the client's global default."""
    from kubernetes.client import Configuration

    return Configuration()


def load_kubeconfig(path: str, configuration: Configuration) -> None:
    """Exec plugins included; the file is never written back."""
    from kubernetes.config import load_kube_config

    load_kube_config(config_file=path, client_configuration=configuration, persist_config=False)


def load_in_cluster(
    token_file: str, ca_file: str, environ: Mapping[str, str], configuration: Configuration
) -> None:
    """The token is read again every minute, as kubelet rotates it."""
    from kubernetes.config.incluster_config import InClusterConfigLoader

    InClusterConfigLoader(
        token_filename=token_file, cert_filename=ca_file, environ=environ
    ).load_and_set(configuration)


def config_error() -> type[Exception]:
    from kubernetes.config import ConfigException

    return ConfigException


def api_exception() -> type[ApiException]:
    """Status 0: no answer (a TLS failure)."""
    from kubernetes.client import ApiException

    return ApiException


def parse_quantity(value: str) -> Decimal:
    from kubernetes.utils import parse_quantity

    return parse_quantity(value)


class KubeClient:
    """The official ``ApiClient`` on ``configuration``, making one request at a time per
    thread and handing back its raw response."""

    def __init__(self, configuration: Configuration, clock: Callable[[], float] = time.monotonic):
        from kubernetes.client import ApiClient

        self.configuration = configuration
        self.api_client = ApiClient(configuration)
        self.user_agent = "gpushare-node"
        self._clock = clock
        # (until when, the bearer token setting or None): what the Configuration said last.
        self._credentials: tuple[float, dict | None] | None = None

    @property
    def user_agent(self) -> str:
        return str(self.api_client.user_agent)

    @user_agent.setter
    def user_agent(self, value: str) -> None:
        self.api_client.user_agent = value

    def request(
        self,
        method: str,
        path: str,
        path_params: Mapping[str, str] | None = None,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str | None = None,
        timeout: float | tuple[float, float] | None = None,
    ) -> Any:
        """The urllib3 response, its body unread; ``ApiException`` for anything but 2xx.
        A token renewed in the Configuration is sent within ``CREDENTIALS_SECONDS``, and
        at the next request after a 401."""
        headers = {"Accept": JSON}
        if body is not None:
            headers["Content-Type"] = content_type or JSON
        token = self.credentials()
        request = self.api_client.param_serialize(
            method,
            path,
            path_params=dict(path_params or {}),
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=AUTH_SETTINGS if token is not None else [],
            _request_auth=token,
        )
        response = self.api_client.call_api(*request, _request_timeout=timeout)
        if not 200 <= response.status <= 299:
            if response.status == 401:
                self._credentials = None  # renewed, maybe: asked again at the next request
            response.read()
            raise api_exception().from_response(http_resp=response, body=None, data=None)
        return response.response

    def credentials(self) -> dict | None:
        """The bearer token setting to send (None: the Configuration has none, as with
        client certificates), asked of the Configuration, and so of its refresh hook, when
        the last answer is older than ``CREDENTIALS_SECONDS`` or was refused."""
        now = self._clock()
        cached = self._credentials
        if cached is None or now >= cached[0]:
            setting = self.configuration.auth_settings().get("BearerToken")
            cached = (now + CREDENTIALS_SECONDS, None if setting is None else dict(setting))
            self._credentials = cached
        return cached[1]

    def close(self) -> None:
        self.api_client.close()


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
        **path_params: str,
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
        return self.api_client.request(
            method, path, path_params, query, body, content_type, timeout
        )


class CoreV1(_Api):
    def list_pod_for_all_namespaces(self, **options: Any) -> Any:
        return self._send("GET", "/api/v1/pods", options, query_names=LIST_QUERY)

    def list_node(self, **options: Any) -> Any:
        return self._send("GET", "/api/v1/nodes", options, query_names=LIST_QUERY)

    def read_node(self, name: str, **options: Any) -> Any:
        return self._send("GET", "/api/v1/nodes/{name}", options, name=name)

    def patch_node(self, name: str, body: Any, **options: Any) -> Any:
        return self._send("PATCH", "/api/v1/nodes/{name}", options, body, name=name)

    def patch_node_status(self, name: str, body: Any, **options: Any) -> Any:
        return self._send("PATCH", "/api/v1/nodes/{name}/status", options, body, name=name)

    def patch_namespaced_pod(self, name: str, namespace: str, body: Any, **options: Any) -> Any:
        path = "/api/v1/namespaces/{namespace}/pods/{name}"
        return self._send("PATCH", path, options, body, name=name, namespace=namespace)

    def create_namespaced_pod_binding(
        self, name: str, namespace: str, body: Any, **options: Any
    ) -> Any:
        path = "/api/v1/namespaces/{namespace}/pods/{name}/binding"
        return self._send("POST", path, options, body, name=name, namespace=namespace)

    def create_namespaced_event(self, namespace: str, body: Any, **options: Any) -> Any:
        path = "/api/v1/namespaces/{namespace}/events"
        return self._send("POST", path, options, body, namespace=namespace)

    def patch_namespaced_event(self, name: str, namespace: str, body: Any, **options: Any) -> Any:
        path = "/api/v1/namespaces/{namespace}/events/{name}"
        return self._send("PATCH", path, options, body, name=name, namespace=namespace)


class ResourceV1(_Api):
    _CLAIM = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
    _SLICES = "/apis/resource.k8s.io/v1/resourceslices"

    def read_namespaced_resource_claim(self, name: str, namespace: str, **options: Any) -> Any:
        return self._send("GET", self._CLAIM, options, name=name, namespace=namespace)

    def replace_namespaced_resource_claim_status(
        self, name: str, namespace: str, body: Any, **options: Any
    ) -> Any:
        path = self._CLAIM + "/status"
        return self._send("PUT", path, options, body, name=name, namespace=namespace)

    def list_resource_slice(self, **options: Any) -> Any:
        return self._send("GET", self._SLICES, options, query_names=LIST_QUERY)

    def read_resource_slice(self, name: str, **options: Any) -> Any:
        return self._send("GET", self._SLICES + "/{name}", options, name=name)

    def create_resource_slice(self, body: Any, **options: Any) -> Any:
        return self._send("POST", self._SLICES, options, body)

    def replace_resource_slice(self, name: str, body: Any, **options: Any) -> Any:
        return self._send("PUT", self._SLICES + "/{name}", options, body, name=name)

    def delete_resource_slice(self, name: str, **options: Any) -> Any:
        return self._send("DELETE", self._SLICES + "/{name}", options, name=name)


class AuthorizationV1(_Api):
    def create_self_subject_access_review(self, body: Any, **options: Any) -> Any:
        path = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
        return self._send("POST", path, options, body)
