"""The nodes of the fault matrix, one per test class (scope "class": each node's MPS
stand-in probes cost CPU, so only one runs at a time). Each starts with pods admitted
through the test kubelet and their long-running containers started through runc."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from standins import real_parts, runc_env
from standins.apiserver_sim import TestApiServer
from standins.daemon_proc import GPU0, GPU1
from tests.faults import survival
from tests.faults.injectors import Ext4Image, mount_tmpfs
from tests.faults.observe import Site, api_pod, wait_annotated
from tests.faults.survival import admit, start_daemon


@pytest.fixture(scope="class")
def site():
    """The node most faults share: three pods, two on GPU0 and one on GPU1."""
    cluster = runc_env.EnforcementNode()
    try:
        pods = [admit(cluster, "keep-a", 4, 30), admit(cluster, "keep-b", 4, 30)]
        # 8 GiB no longer fits GPU0 (admit asks memory first: see survival.MEMORY_FIRST).
        pods.append(admit(cluster, "keep-c", 8, 20))
        assert [p.card for p in pods] == [GPU0, GPU0, GPU1]
        yield Site(cluster, pods)
    finally:
        cluster.close()


@pytest.fixture(scope="class")
def storm_site():
    """A node running NVIDIA's real MPS control binary (a crash loop is paced by what a start
    costs: the stand-in's Python start-ups would set it, not the daemon), one pod on GPU1."""
    cluster = runc_env.EnforcementNode(control_binary=real_parts.require().mps_control)
    try:
        pods = [admit(cluster, "storm-a", 4, 30), admit(cluster, "storm-b", 8, 20)]
        yield Site(cluster, pods)
    finally:
        cluster.close()


@pytest.fixture(scope="class")
def api_site():
    """A node whose daemon uses the test API server (pod identity, annotations)."""
    api = TestApiServer()
    api.start()
    api.add_node("node-a")
    cluster = runc_env.EnforcementNode()
    try:
        cluster.node.stop()
        kubeconfig = api.write_kubeconfig(os.path.join(cluster.node.root, "kubeconfig"))
        cluster.node.rewrite_config(lambda c: c.update(kubernetes={"kubeconfig": kubeconfig}))
        start_daemon(cluster)
        api_pod(api, "api-a", 4, 30)
        site = Site(cluster, [admit(cluster, "api-a", 4, 30)], api=api)
        wait_annotated(site, ["api-a"])
        yield site
    finally:
        cluster.close()
        api.stop()


def _stop_for_unmount(cluster) -> None:
    """Nothing may hold files on state_dir's file system when it is unmounted."""
    cluster.runtime.cleanup()
    cluster.node.stop()


@pytest.fixture(scope="class")
def ro_site():
    """A node whose state_dir is an ext4 file system mounted errors=remount-ro."""
    cluster = runc_env.EnforcementNode()
    state = survival.state_dir(cluster)
    fs = Ext4Image(os.path.join(cluster.node.root, "state.img"), state)
    try:
        cluster.node.stop()
        shutil.rmtree(state)
        fs.mount()
        start_daemon(cluster)
        yield Site(cluster, [admit(cluster, "ro-a", 4, 30)], fs=fs)
    finally:
        _stop_for_unmount(cluster)
        fs.unmount()
        cluster.close()


@pytest.fixture(scope="class")
def full_site():
    """A node whose state_dir is a 1 MiB tmpfs."""
    cluster = runc_env.EnforcementNode()
    state = survival.state_dir(cluster)
    try:
        cluster.node.stop()
        shutil.rmtree(state)
        mount_tmpfs(state, "1m")
        start_daemon(cluster)
        yield Site(cluster, [admit(cluster, "full-a", 4, 30)])
    finally:
        _stop_for_unmount(cluster)
        subprocess.run(["umount", "-l", state], capture_output=True)
        cluster.close()
