"""podman 4.3 (Debian) over runc, with the oci-hooks.d files ``nodemgr install`` wrote
(``--hooks-dir``), against the real gpushare-node on simulated cards and the test
kubelet. Pins: a container asking for no GPU runs; one asking for GPUs without an
allocation is refused with the hook's message; a pod admitted through the device
plugin (its Allocate env and mounts, and the pod identity CRI-O would annotate)
starts and is registered under that identity, another pod reusing its env is
refused (kubelet gives the allocation to the first pod), and ``podman rm`` (podman's cleanup
runs the poststop hook) unregisters it; that env run by hand without pod annotations is
refused; the watchdog kills the process of an over-quota podman container."""

from __future__ import annotations

import time

import pytest

from standins import runc_env
from standins.daemon_proc import GPU0
from tests.engines.conftest import CRIO_CONTAINER, CRIO_NAMESPACE, CRIO_POD

pytestmark = pytest.mark.e2e

KILL_DEADLINE_SECONDS = 2.0  # the promise for action: kill


def crio_annotations(namespace: str, pod: str, container: str) -> dict[str, str]:
    return {CRIO_NAMESPACE: namespace, CRIO_POD: pod, CRIO_CONTAINER: container}


def wait_gone(pid: int, seconds: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if not runc_env.running(pid):
            return time.monotonic() - start
        time.sleep(0.02)
    return None


def test_container_without_gpus_runs(node, podman):
    ran = podman.run("plain", {"HOME": "/"})
    assert ran.returncode == 0, ran.stderr
    assert podman.inspect("plain")["State"]["Running"]
    assert node.registered() == set()


def test_gpus_without_allocation_are_refused_with_the_hooks_message(node, podman):
    ran = podman.run("escape", {"NVIDIA_VISIBLE_DEVICES": "all"})
    assert ran.returncode != 0
    # podman passes on runc's error, which quotes the hook's stderr.
    assert "gpushare-hook: gpushare-node refused container" in ran.stderr
    assert "without a gpushare allocation" in ran.stderr
    assert "NVIDIA_VISIBLE_DEVICES=all" in ran.stderr
    state = podman.inspect("escape")
    assert state is None or not state["State"]["Running"]
    assert node.registered() == set()


def test_admitted_pod_starts_is_registered_and_poststop_unregisters(node, podman):
    env, mounts = node.admit("good")
    ran = podman.run("good", env, mounts, crio_annotations("default", "good", "main"))
    assert ran.returncode == 0, ran.stderr
    assert podman.inspect("good")["State"]["Running"]
    [allocation] = node.node.allocations()
    assert allocation["containers"] == [ran.id]  # podman's container ID, from the OCI state
    assert f"registered container {ran.id} (default/good/main) on allocation" in node.node.log()

    # Another pod's container with the same env: kubelet gives the allocation to default/good.
    thief = podman.run("thief", env, mounts, crio_annotations("default", "thief", "main"))
    assert thief.returncode != 0
    assert "to pod default/good, not to pod default/thief" in thief.stderr
    assert node.registered() == {ran.id}

    assert podman.remove("good").returncode == 0
    node.node.wait_for(lambda: not node.registered(), timeout=5, what="the poststop hook")
    log = node.node.log()
    assert (
        f"unregistered container {ran.id} (stopped)" in log
        or f"unregistered container {ran.id} (its init process is gone; no poststop came)" in log
    )


def test_an_allocations_env_without_a_pod_identity_is_refused(node, podman):
    """``podman run`` by hand with a pod's Allocate env and mounts but no CRI-O pod
    annotations (issue 14, item 4): podman writes no pod identity, so the container
    cannot be tied to the pod its allocation was given to; refused, never registered."""
    env, mounts = node.admit("owner")
    ran = podman.run("byhand", env, mounts)
    assert ran.returncode != 0
    assert "gpushare-hook: gpushare-node refused container" in ran.stderr
    assert "the runtime gave no pod identity" in ran.stderr
    state = podman.inspect("byhand")
    assert state is None or not state["State"]["Running"]
    assert node.registered() == set()


def test_watchdog_kills_an_over_quota_podman_container(node, podman):
    env, mounts = node.admit("hungry")
    ran = podman.run("hungry", env, mounts, crio_annotations("default", "hungry", "main"))
    assert ran.returncode == 0, ran.stderr
    pid = podman.pid("hungry")
    node.set_usage([(pid, GPU0, 4096)])  # at quota: fine
    assert wait_gone(pid, 2.5) is None
    node.set_usage([(pid, GPU0, 5000)])
    took = wait_gone(pid, 5)
    assert took is not None and took < KILL_DEADLINE_SECONDS, took
    log = node.node.log()
    assert "violation (memory)" in log and f"killed process {pid}" in log
    # The container's init is gone: podman sees the container exit.
    node.node.wait_for(
        lambda: not (podman.inspect("hungry") or {"State": {}})["State"].get("Running"),
        timeout=10,
        what="podman to see the container exit",
    )
