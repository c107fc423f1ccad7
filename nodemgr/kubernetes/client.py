"""The Kubernetes adapter's edge with the kubernetes client: credentials, client, errors.

- ``find_credentials``: which credentials, without reading them;
- ``new_api_client``: a ``KubeClient`` on a ``Configuration`` of our own (the client's
  global default is never read or changed);
- ``map_error``: every failure of the client becomes a ``KubeApiError``, here only;
- ``ApiSession``: the client both adapter threads share, and how the last request went;
- ``CommandClient``: the one-shot nodemgr commands' requests, which log nothing.

What it must not do: start threads, sleep or retry (the adapter does).

Longer than 400 lines: the client's whole surface, sharing one error mapping.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import urllib3

from nodemgr.errors import (
    KubeApiError,
    KubeConflict,
    KubeCredentialsError,
    KubeExpired,
    KubeForbidden,
    KubeNotFound,
    KubeUnavailable,
)
from nodemgr.kubernetes import kubeclient
from nodemgr.kubernetes.kubeclient import AuthorizationV1, CoreV1, KubeClient, ResourceV1

if TYPE_CHECKING:
    from nodemgr.kubernetes.kubeclient import ApiException

log = logging.getLogger("nodemgr.kubernetes.adapter")

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
CREDENTIALS_FIX = (
    "set kubernetes.kubeconfig to the kubeconfig of gpushare-node's service account "
    "(e.g. /etc/gpushare/kubeconfig, made as deploy/README.md says), or set "
    "kubernetes.enabled: false to run as a plain device plugin on purpose"
)
RBAC_FIX = (
    "apply the ClusterRole and binding of deploy/ (python deploy/render.py rbac | kubectl "
    "apply -f -, see deploy/README.md)"
)


@dataclass(frozen=True)
class Credentials:
    kind: str  # "kubeconfig" or "in-cluster"
    path: str  # the kubeconfig file(s) ($KUBECONFIG may list several), or the SA directory
    source: str  # for operators: "kubernetes.kubeconfig", "$KUBECONFIG", ...

    def describe(self) -> str:
        return f"{self.source} ({self.path})"


def find_credentials(
    kubeconfig: str,
    environ: Mapping[str, str] | None = None,
    home: str | None = None,
    service_account_dir: str = SERVICE_ACCOUNT_DIR,
) -> Credentials:
    """``kubeconfig`` if set, else $KUBECONFIG, in-cluster, ~/.kube/config; checks only
    that the files exist."""
    environ = os.environ if environ is None else environ
    if kubeconfig:
        # Named on purpose: no fallback to another identity.
        if os.path.isfile(kubeconfig):
            return Credentials("kubeconfig", kubeconfig, "kubernetes.kubeconfig")
        raise KubeCredentialsError(
            f"kubernetes.kubeconfig {kubeconfig}: no such file; create it or {CREDENTIALS_FIX}"
        )
    tried = ["kubernetes.kubeconfig: not set"]
    env_value = environ.get("KUBECONFIG", "")
    if env_value:
        # As kubectl: a list of files, the missing ones ignored.
        if any(os.path.isfile(p) for p in env_value.split(os.pathsep) if p):
            return Credentials("kubeconfig", env_value, "$KUBECONFIG")
        tried.append(f"$KUBECONFIG={env_value}: no such file")
    else:
        tried.append("$KUBECONFIG: not set")
    token_file = os.path.join(service_account_dir, "token")
    if not environ.get("KUBERNETES_SERVICE_HOST"):
        tried.append("in-cluster: $KUBERNETES_SERVICE_HOST not set")
    elif not os.path.isfile(token_file):
        tried.append(f"in-cluster: {token_file}: no such file")
    else:
        return Credentials("in-cluster", service_account_dir, "in-cluster service account")
    home = os.path.expanduser("~") if home is None else home
    default = os.path.join(home, ".kube", "config")
    if os.path.isfile(default):
        return Credentials("kubeconfig", default, "~/.kube/config")
    tried.append(f"{default}: no such file")
    raise KubeCredentialsError(
        f"no Kubernetes credentials (tried {'; '.join(tried)}): {CREDENTIALS_FIX}"
    )


def credentials_problem(message: str) -> str:
    """A credentials error's message without ``CREDENTIALS_FIX``, for callers with another
    fix."""
    problem, found, _ = message.partition(CREDENTIALS_FIX)
    if not found:
        return message
    return re.sub(r"[;:,]?\s*(create it or|fix the file or)?\s*$", "", problem)


def new_api_client(
    credentials: Credentials,
    environ: Mapping[str, str] | None = None,
    pool_size: int = 4,
) -> KubeClient:
    """KubeCredentialsError for an unusable kubeconfig or service account."""
    configuration = kubeclient.new_configuration()
    try:
        if credentials.kind == "in-cluster":
            kubeclient.load_in_cluster(  # re-reads the rotated token every minute
                os.path.join(credentials.path, "token"),
                os.path.join(credentials.path, "ca.crt"),
                os.environ if environ is None else environ,
                configuration,
            )
        else:
            kubeclient.load_kubeconfig(credentials.path, configuration)
    except (kubeclient.config_error(), OSError, ValueError) as e:
        raise KubeCredentialsError(
            f"credentials from {credentials.describe()} are unusable: {e}; fix the file or "
            f"{CREDENTIALS_FIX}"
        ) from e
    except Exception as e:  # the loader runs exec plugins and YAML parsers: anything can fail
        raise KubeCredentialsError(
            f"credentials from {credentials.describe()} are unusable: "
            f"{type(e).__name__}: {e}; {CREDENTIALS_FIX}"
        ) from e
    # urllib3's default would repeat a timed-out GET three times, quadrupling how long a
    # thread is stuck; the adapter's backoff decides when to try again.
    configuration.retries = False
    configuration.connection_pool_maxsize = pool_size  # two threads, one request each
    return KubeClient(configuration)  # User-Agent: gpushare-node


def map_error(error: BaseException, verb: str, resource: str) -> KubeApiError:
    """The KubeApiError for a failed ``verb`` on ``resource`` (e.g. "patch", "pods/ns/name")."""
    if isinstance(error, KubeApiError):
        return error
    what = f"{verb} {resource}"
    if isinstance(error, kubeclient.api_exception()):
        return _map_api_exception(error, what, verb, resource)
    if isinstance(error, (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError)):
        return KubeUnavailable(f"{what}: no answer from the API server: {_short(error)}")
    if isinstance(error, json.JSONDecodeError):  # a body that is not the JSON the API promises
        return KubeUnavailable(f"{what}: unreadable answer from the API server: {error}")
    return KubeApiError(f"{what}: {type(error).__name__}: {error}")


def _map_api_exception(error: ApiException, what: str, verb: str, resource: str) -> KubeApiError:
    status = error.status or None  # the client says 0 for a TLS failure
    detail = _status_message(error)
    if status is None:
        return KubeUnavailable(f"{what}: no answer from the API server: {detail}")
    if status == 401:
        return KubeForbidden(
            f"{what}: HTTP 401, the API server rejected gpushare-node's credentials "
            f"({detail}); the token in the kubeconfig is wrong or revoked",
            401,
        )
    if status == 403:
        rbac_resource = resource.split("/", 1)[0]
        if "/status" in resource:
            rbac_resource += "/status"
        return KubeForbidden(
            f"{what}: HTTP 403, gpushare-node's identity may not {verb} {rbac_resource} "
            f"({detail}); {RBAC_FIX}",
            403,
        )
    if status == 404:
        return KubeNotFound(f"{what}: HTTP 404, not found ({detail})", 404)
    if status == 409:
        return KubeConflict(f"{what}: HTTP 409, conflict ({detail})", 409)
    if status == 410:
        return KubeExpired(f"{what}: HTTP 410, gone ({detail})", 410)
    if status == 429 or status >= 500:
        return KubeUnavailable(f"{what}: HTTP {status} ({detail}); retrying later", status)
    return KubeApiError(f"{what}: HTTP {status} ({detail})", status)


def request_json(
    verb: str, resource: str, timeout_seconds: float, method: Callable[..., Any], *args, **kwargs
) -> Any:
    """The decoded JSON answer (not the client's models); ``verb`` and ``resource`` name
    it in errors."""
    try:
        response = method(*args, _preload_content=False, _request_timeout=timeout_seconds, **kwargs)
        try:
            data = response.data
        finally:
            response.release_conn()
        return json.loads(data) if data else {}
    except Exception as e:
        raise map_error(e, verb, resource) from e


def _status_message(error: ApiException) -> str:
    """The API server's own explanation (a Status object's message), else the HTTP reason."""
    body = error.body
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if body:
        try:
            message = json.loads(body).get("message")
            if message:
                return str(message)
        except (ValueError, AttributeError):
            pass
    return str(error.reason or "no reason given").strip()


def _short(error: BaseException) -> str:
    """The innermost reason of urllib3's nested reprs."""
    reason = getattr(error, "reason", None)
    if isinstance(reason, BaseException):
        return _short(reason)
    return f"{type(error).__name__}: {error}"


def status_error(status: Mapping[str, Any], verb: str, resource: str) -> KubeApiError:
    """The error for a Status object the server sent inside a watch stream (type ERROR)."""
    code = status.get("code")
    error = kubeclient.api_exception()(
        status=code if isinstance(code, int) else None, reason=status.get("reason")
    )
    error.body = json.dumps(dict(status))
    return map_error(error, verb, resource)


def rfc3339(unix_seconds: float) -> str:
    """Unix seconds as the API's timestamp text (second precision, UTC)."""
    return datetime.fromtimestamp(unix_seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiSession:
    """The API client the watch and writer threads share. ``connected``: the last request
    got an answer (not 5xx or 429). A loss and a recovery are logged once each, an RBAC
    refusal once per message."""

    def __init__(
        self,
        api_client: KubeClient,
        timeout_seconds: float,
        clock: Callable[[], float],
        on_reconnect: Callable[[], None] = lambda: None,
    ):
        self.api_client = api_client
        self.core = CoreV1(api_client)
        self.resource = ResourceV1(api_client)  # resource.k8s.io/v1 (DRA)
        self.timeout_seconds = timeout_seconds
        self._clock = clock
        self._on_reconnect = on_reconnect  # the writer's backoffs end: retry everything now
        self._lock = threading.Lock()
        self.connected = False
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self._logged: set[str] = set()

    @property
    def host(self) -> str:
        return self.api_client.configuration.host

    def call(self, verb: str, resource: str, method: Callable[..., Any], *args, **kwargs) -> Any:
        """As ``request_json``."""
        try:
            result = request_json(verb, resource, self.timeout_seconds, method, *args, **kwargs)
        except KubeApiError as error:
            self.note_error(error)
            raise
        self.note_ok()
        return result

    def note_ok(self) -> None:
        with self._lock:
            if self.connected:
                return
            self.connected = True
            recovered = self.last_error_at is not None
        if recovered:
            log.info("Kubernetes API server answers again")
        self._on_reconnect()

    def note_error(self, error: KubeApiError) -> None:
        unavailable = isinstance(error, KubeUnavailable)
        with self._lock:
            was_connected = self.connected
            self.connected = not unavailable  # any other error is an answer
            if not isinstance(error, (KubeNotFound, KubeExpired)):  # routine answers
                self.last_error, self.last_error_at = str(error), self._clock()
        if unavailable and was_connected:
            log.warning("Kubernetes API server unavailable, retrying with backoff: %s", error)
        elif isinstance(error, KubeForbidden):
            self.log_once(str(error), logging.ERROR)

    def log_once(self, message: str, level: int) -> None:
        with self._lock:
            if message in self._logged:
                return
            self._logged.add(message)
        log.log(level, "%s", message)

    def close(self) -> None:
        self.api_client.close()


@dataclass(frozen=True)
class NodeSummary:
    name: str
    internal_ip: str | None  # status.addresses of type InternalIP
    annotations: Mapping[str, str]


class CommandClient:
    """For ``doctor`` and ``status --cluster``: no threads, retries or log lines (the
    command reports what went wrong)."""

    def __init__(
        self,
        credentials: Credentials,
        timeout_seconds: float,
        environ: Mapping[str, str] | None = None,
    ):
        self.credentials = credentials
        self.timeout_seconds = timeout_seconds
        self._client = new_api_client(credentials, environ, pool_size=1)
        self._core = CoreV1(self._client)
        self._authorization = AuthorizationV1(self._client)

    @property
    def server(self) -> str:
        return self._client.configuration.host

    def read_node(self, name: str) -> dict:
        return request_json(
            "get", f"nodes/{name}", self.timeout_seconds, self._core.read_node, name
        )

    def can_i(self, verb: str, group: str, resource: str, name: str = "") -> tuple[bool, str]:
        """(allowed, the authorizer's reason), asked as ``kubectl auth can-i``: a
        SelfSubjectAccessReview (every authenticated user may create one), cluster-wide."""
        plural, _, subresource = resource.partition("/")
        attributes = {"group": group, "resource": plural, "verb": verb}
        if subresource:
            attributes["subresource"] = subresource
        if name:
            attributes["name"] = name
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attributes},
        }
        answer = request_json(
            "create",
            "selfsubjectaccessreviews",
            self.timeout_seconds,
            self._authorization.create_self_subject_access_review,
            review,
        )
        status = answer.get("status") or {}
        reason = status.get("reason") or status.get("evaluationError") or ""
        return status.get("allowed") is True, str(reason)

    def list_nodes(self, page_size: int = 500) -> list[NodeSummary]:
        nodes: list[NodeSummary] = []
        token = ""
        while True:
            page = request_json(
                "list",
                "nodes",
                self.timeout_seconds,
                self._core.list_node,
                limit=page_size,
                **({"_continue": token} if token else {}),
            )
            for item in page.get("items") or []:
                metadata = item.get("metadata") or {}
                addresses = (item.get("status") or {}).get("addresses") or []
                internal = [a.get("address") for a in addresses if a.get("type") == "InternalIP"]
                nodes.append(
                    NodeSummary(
                        str(metadata.get("name", "")),
                        internal[0] if internal else None,
                        dict(metadata.get("annotations") or {}),
                    )
                )
            token = (page.get("metadata") or {}).get("continue") or ""
            if not token:
                return nodes

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> CommandClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
