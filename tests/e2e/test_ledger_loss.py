"""End to end: a lost ledger. Pins that a state_dir removed while gpushare-node runs is
noticed at once (not at the next start), said loudly, and rewritten from the daemon's open
copy, so a restart afterwards still knows every allocation under its old ID; and that a
ledger moved aside while the daemon is stopped is rebuilt at the next start from kubelet's
record and the running containers' cgroup marks without breaking a real runc container."""

import os
import shutil
import time
import uuid

import pytest

from standins import runc_env
from standins.daemon_proc import CORE, GPU0, MEMORY, WHOLE, Node
from standins.kubelet_sim import ContainerSpec, TestKubelet

pytestmark = pytest.mark.e2e


@pytest.fixture
def node():
    node = Node()
    kubelet = TestKubelet(node.device_plugin_dir, node.pod_resources_socket)
    kubelet.start()
    node.kubelet = kubelet
    node.start()
    for resource in (MEMORY, CORE, WHOLE):
        kubelet.wait_for_resource(resource, timeout=20)
    yield node
    node.cleanup()
    kubelet.stop()


def test_a_state_dir_removed_while_running_is_rewritten_at_once(node):
    """rm -rf of state_dir with two pods admitted: within a run loop tick the ledger file is
    back with both allocations, the log says CRITICAL what happened, and after a restart
    the daemon still holds both allocation IDs (the pods' env names them)."""
    ids = []
    for name in ("pod-a", "pod-b"):
        result = node.kubelet.admit_pod(
            "default", name, [ContainerSpec("main", {MEMORY: 2, CORE: 10})]
        )
        assert result.ok, result.error
        ids.append(result.containers[0].envs["GPUSHARE_ALLOCATION_ID"])
    state_dir = os.path.join(node.root, "state")
    ledger_file = os.path.join(state_dir, "ledger.sqlite")
    node.wait_for(lambda: os.path.exists(ledger_file), what="the ledger file")
    # Gone in one step (rm -rf file by file could race the daemon's rewrite into the dir).
    os.rename(state_dir, state_dir + ".gone")
    shutil.rmtree(state_dir + ".gone")
    node.wait_for(lambda: os.path.exists(ledger_file), timeout=5, what="the ledger rewritten")
    node.wait_for(lambda: "rewrote it from the daemon's open copy" in node.log(), timeout=5)
    assert "was deleted while gpushare-node ran" in node.log()
    node.stop()
    node.start()
    node.kubelet.wait_for_resource(MEMORY, timeout=20)
    assert sorted(a["id"] for a in node.allocations()) == sorted(ids)


@pytest.fixture
def cluster():
    cluster = runc_env.EnforcementNode()
    yield cluster
    cluster.close()


def still_running_after(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not runc_env.running(pid):
            return False
        time.sleep(0.05)
    return True


def test_the_documented_recovery_keeps_every_running_container_working(cluster):
    """The ledger is moved aside while the daemon is stopped (the documented recovery for a
    broken ledger). At the next start a real runc container admitted before keeps its
    registration (read back from its cgroup's mark) and its allocation ID (the one in its
    env): its in-quota process is not killed as unallocated, an over-quota one still is,
    and a new container of the pod started with the env kubelet cached is admitted."""
    # Marks are read from every cgroup of the machine, so other tests' runc containers
    # (other daemons', running meanwhile or left behind) are read too: this pod and its
    # containers have names no other run uses, so none of theirs can pass for this one.
    pod = f"steady-{uuid.uuid4().hex[:8]}"
    env, mounts = cluster.admit(pod)
    assert cluster.start_in_pod(pod, pod, env, mounts).returncode == 0
    pid = cluster.runtime.pid(pod)
    cluster.set_usage([(pid, GPU0, 1000)])
    cluster.node.stop()
    state_dir = os.path.join(cluster.node.root, "state")
    os.rename(state_dir, state_dir + ".aside")
    # The log goes on across starts, and the first start may already have logged a recovery
    # (of other tests' marked containers, for a ledger made then): only the line this start
    # logs for this node's ledger counts.
    logged_before = len(cluster.node.log())
    recovered = "container registrations from their cgroups into the ledger " + os.path.join(
        state_dir, "ledger.sqlite"
    )
    cluster.node.start()
    cluster.node.wait_for(
        lambda: recovered in cluster.node.log()[logged_before:],
        timeout=30,
        what="this start's recovery of the container registrations",
    )
    cluster.kubelet.wait_for_resource(MEMORY, timeout=30)
    assert [a["id"] for a in cluster.node.allocations()] == [env["GPUSHARE_ALLOCATION_ID"]]
    assert cluster.registered() == {pod}
    assert still_running_after(pid, 2.5), "an in-quota process was killed after the recovery"
    done = cluster.start_in_pod(pod + "-2", pod, env, mounts, container="main")
    assert done.returncode == 0, done.stdout
    cluster.set_usage([(pid, GPU0, 9000)])
    assert not still_running_after(pid, 3.0), "the recovered container is not policed"
