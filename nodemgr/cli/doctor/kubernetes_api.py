"""Doctor's ``Kubernetes API`` check: credentials, the API server, this node, and RBAC.

One SelfSubjectAccessReview per verb the daemon uses (what ``kubectl auth can-i`` sends:
the server answers and stores nothing). With ``kubernetes.enabled: false`` it warns what
is lost and sends nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from nodemgr.cli.doctor.host import Host
from nodemgr.cli.doctor.report import FAIL, PASS, WARN, Result
from nodemgr.config.schema import Settings
from nodemgr.errors import KubeApiError, KubeCredentialsError, KubeNotFound, KubeUnavailable

KUBERNETES_CHECK = "Kubernetes API"
KUBERNETES_DISABLED = (
    "disabled: no pod annotations, node labels or events; the gpushare scheduler extender and "
    "kubectl inspect gpushare won't see this node's allocations"
)


@dataclass(frozen=True)
class KubeProbe:
    credentials: str  # Credentials.describe()
    server: str
    node_name: str
    node: str | None = None  # found, missing; None: not known (the GET failed)
    node_error: str | None = None  # why the GET of the node was refused (403)
    error: str | None = None  # the request that failed and why
    error_status: int | None = None  # None: no answer
    unavailable: bool = False  # no answer (refused, timeout, TLS), 5xx or 429
    checked: tuple[tuple[str, str, str], ...] = ()  # (group, resource, verb)
    denied: tuple[tuple[str, str, str], ...] = ()


def check_kubernetes(settings: Settings, host: Host) -> Result:
    kubernetes = settings.kubernetes
    if not kubernetes.enabled:
        return kubernetes_disabled_result()
    # The kubernetes client takes half a second to load; other commands need not pay it.
    from nodemgr.kubernetes import adapter as kube
    from nodemgr.kubernetes import client as kube_client

    try:
        credentials = kube_client.find_credentials(
            kubernetes.kubeconfig,
            service_account_dir=host.path(kube_client.SERVICE_ACCOUNT_DIR),
        )
        client = kube_client.CommandClient(credentials, kubernetes.request_timeout_seconds)
    except KubeCredentialsError as e:
        return kubernetes_credentials_result(
            kube_client.credentials_problem(str(e)), kube_client.CREDENTIALS_FIX
        )
    permissions = kube.API_PERMISSIONS
    driver = None
    if settings.dra.enabled:  # the DRA front door's requests too (render.py dra grants them)
        from nodemgr.kubernetes.dra import DRA_API_PERMISSIONS

        permissions, driver = permissions + DRA_API_PERMISSIONS, settings.dra.driver
    with client:
        return kubernetes_result(probe_kubernetes(client, settings.node_name, permissions, driver))


def probe_kubernetes(client, node_name: str, permissions, driver: str | None = None) -> KubeProbe:
    """Stops at the first request that gets no usable answer."""
    found = KubeProbe(client.credentials.describe(), client.server, node_name)
    try:
        client.read_node(node_name)
        node = "found"
    except KubeNotFound:
        node = "missing"
    except KubeApiError as e:
        if e.status != 403:  # 403: RBAC, which the reviews below name exactly
            return _failed(found, e)
        node, found = None, replace(found, node_error=str(e))
    checked, denied = [], []
    for group, resource, verbs in permissions:
        # The adapter reads and patches only its own Node: ask about that one; the DRA
        # driver's claim status, by its driver name.
        name = node_name if resource.partition("/")[0] == "nodes" else ""
        if resource == "resourceclaims/driver" and driver:
            name = driver
        for verb in verbs:
            try:
                allowed, _ = client.can_i(verb, group, resource, name)
            except KubeApiError as e:
                return _failed(found, e, "cannot review RBAC: ")
            checked.append((group, resource, verb))
            if not allowed:
                denied.append((group, resource, verb))
    return replace(found, node=node, checked=tuple(checked), denied=tuple(denied))


def _failed(probe: KubeProbe, error: KubeApiError, prefix: str = "") -> KubeProbe:
    return replace(
        probe,
        error=prefix + str(error),
        error_status=error.status,
        unavailable=isinstance(error, KubeUnavailable),
    )


def kubernetes_disabled_result() -> Result:
    return Result(
        KUBERNETES_CHECK,
        WARN,
        KUBERNETES_DISABLED,
        "set kubernetes.enabled: true and give gpushare-node credentials: kubernetes.kubeconfig "
        "naming its service account's kubeconfig, made as deploy/README.md says",
    )


def kubernetes_credentials_result(problem: str, fix: str) -> Result:
    return Result(
        KUBERNETES_CHECK,
        FAIL,
        f"kubernetes.enabled, but {problem}: gpushare-node would run as a plain device plugin "
        "(no pod annotations, node labels or events)",
        fix,
    )


def kubernetes_result(probe: KubeProbe) -> Result:
    where = f"{probe.server} (credentials from {probe.credentials})"
    if probe.error is not None:
        if probe.unavailable:
            return Result(
                KUBERNETES_CHECK,
                FAIL,
                f"API server {where} unreachable: {probe.error}",
                "check the server address in the kubeconfig, that the API server runs and that "
                "this node reaches it (firewall, proxy); meanwhile gpushare-node runs as a plain "
                "device plugin and retries",
            )
        if probe.error_status == 401:
            return Result(
                KUBERNETES_CHECK,
                FAIL,
                f"API server {probe.server}: credentials rejected (from {probe.credentials}): "
                f"{probe.error}",
                "make the kubeconfig again from the gpushare-node-token Secret (`python "
                "deploy/render.py kubeconfig`, deploy/README.md) and copy it to this node",
            )
        return Result(
            KUBERNETES_CHECK,
            FAIL,
            f"API server {where}: {probe.error}",
            "see the API server's answer; `kubectl auth can-i --list` with the same kubeconfig "
            "shows what it may do",
        )
    missing_node = (
        f"node {probe.node_name} does not exist there (node_name wrong? kubelet not registered "
        "yet?)"
    )
    if probe.denied:
        detail = (
            f"API server {where}: RBAC denies {len(probe.denied)} of the {len(probe.checked)} "
            f"requests gpushare-node makes: {_verbs_on(probe.denied)} missing"
        )
        if probe.node == "missing":
            detail += f"; {missing_node}"
        return Result(
            KUBERNETES_CHECK,
            FAIL,
            detail,
            "apply the ClusterRole and binding of deploy/: `python deploy/render.py rbac | "
            "kubectl apply -f -` (and `render.py dra` with dra.enabled; deploy/README.md); if "
            "they are applied, the kubeconfig is not that of their service account",
        )
    allowed = f"RBAC allows every request gpushare-node makes ({_verbs_on(probe.checked)})"
    if probe.node is None:  # refused although the reviews allow it: another authorizer
        return Result(
            KUBERNETES_CHECK,
            FAIL,
            f"API server {where}: the reviews say {allowed}, yet {probe.node_error}",
            "look at the cluster's other authorizers (webhook, ABAC) for this identity; "
            "`kubectl auth can-i get nodes/NAME` with the same kubeconfig",
        )
    if probe.node == "missing":
        return Result(
            KUBERNETES_CHECK,
            WARN,
            f"API server {where}: {allowed}, but {missing_node}",
            "set node_name to this node's name in `kubectl get nodes` (default: $NODE_NAME, else "
            "the lowercased hostname); a node kubelet has not registered yet appears by itself",
        )
    return Result(
        KUBERNETES_CHECK, PASS, f"API server {where}: node {probe.node_name} found; {allowed}"
    )


def _verbs_on(permissions: Iterable[tuple[str, str, str]]) -> str:
    """``get, list on pods; patch on nodes/status``, in the order given."""
    verbs: dict[str, list[str]] = {}
    for group, resource, verb in permissions:
        verbs.setdefault(f"{resource}.{group}" if group else resource, []).append(verb)
    return "; ".join(f"{', '.join(v)} on {resource}" for resource, v in verbs.items())
