"""What the fault matrix looks at during a fault: device health as kubelet sees it, the
daemon's log, its answers on the hook socket and the device plugin socket, refusals
while state_dir cannot be written, the pods' annotations in the API server."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from dataclasses import dataclass

import grpc

from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2 as dp
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from standins import runc_env
from standins.apiserver_sim import TestApiServer
from standins.daemon_proc import CORE, MEMORY
from standins.kubelet_sim import ContainerSpec
from tests.faults import survival
from tests.faults.injectors import Ext4Image
from tests.faults.survival import CONTAINER, MEMORY_FIRST, NAMESPACE, Pod


@dataclass
class Site:
    """A node and the pods admitted on it before its faults."""

    cluster: runc_env.EnforcementNode
    pods: list[Pod]
    api: TestApiServer | None = None
    fs: Ext4Image | None = None

    def after(self, tag: str, extra=(), runners_restarted: bool = False) -> str:
        """Every check of survival.after_fault; the row's "what is kept" cell."""
        kept = survival.after_fault(self.cluster, self.pods, tag, extra)
        return kept.row(runners_restarted)

    def log_mark(self) -> int:
        return len(self.cluster.node.log())

    def log_since(self, mark: int) -> str:
        return self.cluster.node.log()[mark:]


def exit_described(status: int) -> str:
    return f"dies ({signal.Signals(-status).name})" if status < 0 else f"exits {status}"


# ---------------------------------------------------------------------- MPS


def card_health(kubelet, resource: str, card: str) -> str:
    """The health kubelet sees for ``card``'s devices of ``resource`` ("A/B" if mixed)."""
    states = {d.health for d in kubelet.devices(resource) if d.id.split("-_-")[0] == card}
    return "/".join(sorted(states)) or "absent"


def wait_card(cluster, card: str, health: str, timeout: float = 30.0) -> None:
    """Until kubelet sees every shared device of ``card`` with ``health``."""
    for resource in (MEMORY, CORE):
        cluster.kubelet.wait_for_devices(
            resource,
            lambda ds: {d.health for d in ds if d.id.split("-_-")[0] == card} == {health},
            timeout=timeout,
        )


def problem_logged(site: Site, mark: int, card_index: int) -> str:
    """The supervisor's summary of a card's MPS problem, as logged since ``mark``."""
    pattern = rf"GPU{card_index}: (MPS control daemon [^,]+), its shared devices are Unhealthy"
    found = site.cluster.node.wait_for(
        lambda: re.search(pattern, site.log_since(mark)), what="the MPS problem in the log"
    )
    return found.group(1)


# ---------------------------------------------------------------------- hook and plugin input

MALFORMED = (
    ("not JSON", b"hello gpushare\n"),
    ("not an object", b"[1, 2, 3]\n"),
    ("invalid UTF-8", b'{"stage": "createRuntime\xff\xfe"}\n'),
    ("no container id", b'{"stage": "createRuntime"}\n'),
    (
        "wrong types",
        b'{"stage": "createRuntime", "container_id": 5, "pid": "x", "env": [1], '
        b'"identity": 1, "cgroup": null, "spec": "x"}\n',
    ),
    ("unknown stage", b'{"stage": "prestart", "container_id": "c"}\n'),
    ("over 1 MiB", b'{"pad": "' + b"x" * (1 << 20) + b'"}\n'),
    ("nothing", b""),
)
BAD_OCI_STATES = (b"", b"not json", b"[]", b'{"id": 5, "bundle": 7}', b'{"bundle": "/none"}')


def hook_exchange(socket_path: str, data: bytes) -> str | None:
    """Send ``data`` to the hook socket; the answer, or None if it closed unanswered."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(socket_path)
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # it answered and closed before reading it all
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass  # it answered and closed with our bytes unread
    return b"".join(chunks).decode() or None


def run_hook(cluster, stdin: bytes) -> int:
    """gpushare-hook as the runtime runs it at createRuntime, with ``stdin`` as OCI state."""
    argv = [runc_env.hook_command(), "--socket", cluster.hook_socket, "createRuntime"]
    return subprocess.run(argv, input=stdin, capture_output=True, timeout=30).returncode


def allocate_directly(cluster, resource: str, ids: list[str]) -> tuple[str, str]:
    """Allocate ``ids`` on the resource's plugin socket, as kubelet would; the refusal's
    gRPC code and details (it must refuse)."""
    endpoint = [
        r.endpoint
        for r in cluster.kubelet.registrations()
        if r.resource_name == resource and r.error is None
    ][-1]
    address = "unix://" + os.path.join(cluster.node.device_plugin_dir, endpoint)
    request = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)])
    with grpc.insecure_channel(address) as channel:
        try:
            dp_grpc.DevicePluginStub(channel).Allocate(request, timeout=10)
        except grpc.RpcError as e:
            return e.code().name, e.details() or ""
    raise AssertionError(f"Allocate of unknown IDs {ids} on {resource} succeeded")


# ---------------------------------------------------------------------- the API server


def api_pod(api: TestApiServer, name: str, memory_gib: int, core_percent: int) -> None:
    """The scheduler bound a pod to node-a: it is in the API before kubelet admits it."""
    requests = {MEMORY: str(memory_gib), CORE: str(core_percent)}
    api.add_pod(NAMESPACE, name, "node-a", containers=[{"name": CONTAINER, "requests": requests}])


def wait_annotated(site: Site, names: list[str], timeout: float = 90.0) -> None:
    """Until the daemon has written the gpushare annotations on every pod named."""
    assert site.api is not None

    def assigned() -> bool:
        pods = [site.api.pod(NAMESPACE, n) for n in names]
        return all(
            p["metadata"].get("annotations", {}).get("ALIYUN_COM_GPU_MEM_ASSIGNED") == "true"
            for p in pods
        )

    site.cluster.node.wait_for(assigned, timeout=timeout, what=f"annotations on {names}")


# ---------------------------------------------------------------------- state_dir


def ledger_cause(message: str) -> str:
    """The daemon's reason after "cannot write the ledger <path>: " (the path varies), up
    to where it goes on to say what to do."""
    found = re.search(r"cannot write the ledger \S+: ([^;(]+)", message)
    assert found, message
    return found.group(1).strip()


def allocate_refused(site: Site, tag: str) -> str:
    """Allocate's refusal of a new pod while the ledger cannot be written."""
    spec = ContainerSpec(CONTAINER, {MEMORY: 1, CORE: 5})
    result = site.cluster.kubelet.admit_pod(NAMESPACE, f"{tag}-new", [spec], order=MEMORY_FIRST)
    site.cluster.kubelet.remove_pod(NAMESPACE, f"{tag}-new")
    assert not result.ok, "Allocate succeeded although the ledger cannot be written"
    return result.error or ""


def hook_refused(site: Site, tag: str) -> str:
    """The runtime hook's refusal of a new container of an admitted pod while the ledger
    cannot be written (it cannot be recorded)."""
    pod = site.pods[0]
    done = site.cluster.start_in_pod(f"{pod.name}-{tag}-refused", pod.name, pod.env, pod.mounts)
    assert done.returncode != 0, "a container was admitted although it cannot be recorded"
    assert "cannot record it" in done.stdout, done.stdout
    return done.stdout
