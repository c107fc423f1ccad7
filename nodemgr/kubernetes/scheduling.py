"""The scheduler extender's requests: its session, the pod annotations and the Binding.

For nodemgr.extender, which may not import the kubernetes client itself. A Binding
carries the pod's UID as precondition, so a pod made again under the same name is never
bound by a decision made for the old one. RBAC: pods patch, pods/binding create, events
create (deploy/templates/scheduler-rbac.yaml.j2).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from nodemgr.kubernetes.client import ApiSession, find_credentials, new_api_client, rfc3339

MERGE_PATCH = "application/merge-patch+json"
EVENT_COMPONENT = "gpushare-scheduler"


def open_session(kubeconfig: str, timeout_seconds: float, pool_size: int = 8) -> ApiSession:
    credentials = find_credentials(kubeconfig)
    client = new_api_client(credentials, pool_size=pool_size)
    client.user_agent = "gpushare-scheduler"
    return ApiSession(client, timeout_seconds, time.time)


def describe_credentials(kubeconfig: str) -> str:
    return find_credentials(kubeconfig).describe()


def patch_pod_annotations(
    session: ApiSession, namespace: str, name: str, annotations: Mapping[str, str]
) -> None:
    session.call(
        "patch",
        f"pods/{namespace}/{name}",
        session.core.patch_namespaced_pod,
        name,
        namespace,
        {"metadata": {"annotations": dict(annotations)}},
        _content_type=MERGE_PATCH,
    )


def create_binding(session: ApiSession, namespace: str, name: str, uid: str, node: str) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": name, "namespace": namespace, **({"uid": uid} if uid else {})},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }
    session.call(
        "create",
        f"pods/{namespace}/{name}/binding",
        session.core.create_namespaced_pod_binding,
        name,
        namespace,
        body,
    )


def create_event(
    session: ApiSession,
    namespace: str,
    pod: str,
    uid: str,
    reason: str,
    message: str,
    count: int = 1,
) -> None:
    """A new one per call: the caller rate-limits."""
    now = rfc3339(time.time())
    involved = {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": pod}
    if uid:
        involved["uid"] = uid
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{pod[:230]}.{time.time_ns():x}", "namespace": namespace},
        "involvedObject": involved,
        "reason": reason,
        "message": message[:1024],
        "type": "Warning",
        "count": count,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "source": {"component": EVENT_COMPONENT},
        "reportingComponent": EVENT_COMPONENT,
        "reportingInstance": EVENT_COMPONENT,
    }
    session.call(
        "create",
        f"events/{namespace}",
        session.core.create_namespaced_event,
        namespace,
        body,
    )
