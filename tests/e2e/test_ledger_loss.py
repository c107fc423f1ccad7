"""End to end: a ledger lost under the running daemon. Pins that a state_dir removed
while gpushare-node runs is noticed at once (not at the next start), said loudly, and
rewritten from the daemon's open copy, so a restart afterwards still knows every
allocation under its old ID."""

import os
import shutil

import pytest

from tests.harness.daemon_proc import CORE, MEMORY, WHOLE, Node
from tests.harness.kubelet_sim import ContainerSpec, TestKubelet

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
