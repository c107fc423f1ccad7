"""The same enforcement for a DRA claim as for a device plugin allocation, with real runc
containers and the real gpushare-node: the container is made from the claim's CDI spec
(its env and mounts, as the runtime applies them; podman's own CDI injection is
tests/engines/test_podman_cdi.py), the runtime hook ties it to the claim through
kubelet's PodResources ``dynamic_resources`` (the test kubelet's DRA side), a container
of a pod not holding the claim is refused it, and the watchdog kills a process over the
claim's memory, summed over the claim's containers."""

from __future__ import annotations

import time

import pytest

from standins import runc_env
from standins.dra_enforcement import DraEnforcementNode

pytestmark = pytest.mark.e2e


@pytest.fixture
def cluster():
    cluster = DraEnforcementNode()
    yield cluster
    cluster.close()


def wait_gone(pid, seconds):
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if not runc_env.running(pid):
            return time.monotonic() - start
        time.sleep(0.02)
    return None


def test_a_claims_container_is_tied_to_it_and_killed_over_its_memory(cluster):
    """Made from the claim's CDI spec in the claim's pod: registered on the claim's
    allocation. Over 4 GiB (the claim's consumed memory): killed within 2 s."""
    env, mounts = cluster.prepared_pod("train", "c1", {"memory": "4Gi", "cores": "30"})
    done = cluster.start_in_pod("train", "train", env, mounts)
    assert done.returncode == 0, done.stdout
    [allocation] = cluster.node.allocations()
    assert allocation["containers"] == ["train"] and allocation["claim"]["name"] == "c1"
    pid = cluster.runtime.pid("train")
    card = env["NVIDIA_VISIBLE_DEVICES"]
    cluster.set_usage([(pid, card, 4096)])
    assert wait_gone(pid, 2.5) is None
    cluster.set_usage([(pid, card, 5000)])
    took = wait_gone(pid, 5)
    assert took is not None and took < 2.0, took
    cluster.node.wait_for(lambda: f"killed process {pid}" in cluster.node.log(), what="the kill")


def test_a_container_of_a_pod_without_the_claim_is_refused_it(cluster):
    """The claim's env copied into another pod's container: kubelet's record does not
    list that pod with the claim's device, so the hook refuses it."""
    env, mounts = cluster.prepared_pod("train", "c1", {"memory": "2Gi"})
    done = cluster.start_in_pod("thief", "thief", env, mounts)
    assert done.returncode != 0
    assert "not to pod default/thief" in done.stdout


def test_a_claim_shared_by_two_pods_ties_both_and_sums_their_memory(cluster):
    """One claim reserved for two pods: both pods' containers are tied to it, and its
    4 GiB is their sum: together over it, the newest process is killed."""
    env, mounts = cluster.prepared_pod("a", "shared", {"memory": "4Gi"})
    env_b, mounts_b = cluster.prepared_pod("b", "shared", {"memory": "4Gi"})
    assert env_b == env
    assert cluster.start_in_pod("a", "a", env, mounts).returncode == 0
    assert cluster.start_in_pod("b", "b", env_b, mounts_b).returncode == 0
    [allocation] = cluster.node.allocations()
    assert sorted(allocation["containers"]) == ["a", "b"]
    card = env["NVIDIA_VISIBLE_DEVICES"]
    first, second = cluster.runtime.pid("a"), cluster.runtime.pid("b")
    cluster.set_usage([(first, card, 3000), (second, card, 2000)])
    assert wait_gone(second, 5) is not None
    assert runc_env.running(first)
