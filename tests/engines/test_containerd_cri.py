"""containerd 1.6 (Debian) with its CRI plugin, driven through the real CRI v1 gRPC API
(RunPodSandbox, CreateContainer, StartContainer) like kubelet, its runc runtime's
``base_runtime_spec`` the JSON the installed ``make-base-spec`` prints, against the
real gpushare-node on simulated cards and the test kubelet. Pins: a container with
the envs and mounts of a real Allocate answer starts and is registered under the pod
identity containerd annotates (the pause sandboxes get no hook: containerd 1.6
applies ``base_runtime_spec`` to containers only); a container of another pod
reusing that env is refused with the hook's message; a GPU container without
allocation is refused; removing the pod unregisters its container (poststop). And
one whole node path: the test kubelet in CRI mode admits a pod through the device
plugin, creates it through containerd's CRI, the hook registers it, and the
watchdog kills its over-quota process. And the base spec changes nothing but the hooks:
the same container under a second runtime without ``base_runtime_spec`` (containerd's CRI
default spec) gets the same runtime spec and the same rlimits. And ``nodemgr doctor`` finds
the config this containerd was started with from the running process."""

from __future__ import annotations

import json
import os
import time

import grpc
import pytest

from nodemgr.cli.doctor import runtime_hook
from nodemgr.cli.doctor.host import Host
from nodemgr.config.loading import load_settings
from standins import runc_env
from standins.cri import configs
from standins.cri import containerd as containerd_harness
from standins.cri.api import runtime_v1_pb2 as cri
from standins.daemon_proc import CORE, GPU0, MEMORY
from standins.kubelet_sim import ContainerSpec
from tests.engines.conftest import leftover_cgroups, new_uid

pytestmark = pytest.mark.e2e

KILL_DEADLINE_SECONDS = 2.0  # the promise for action: kill


def admit(node, pod: str):
    """The Allocate answers of pod default/<pod>'s container "main" (4 GiB, 30 %)."""
    result = node.kubelet.admit_pod("default", pod, [ContainerSpec("main", {MEMORY: 4, CORE: 30})])
    assert result.ok, result.error
    return result.containers[0]


def start(containerd, engines, namespace: str, pod: str, envs, mounts=()):
    """A new sandbox for namespace/pod and its container "main" with these envs and
    mounts: (sandbox ID, container ID, the StartContainer error or None)."""
    sandbox = configs.sandbox_config(namespace, pod, new_uid(), containerd.log_root)
    sandbox_id = containerd.run_pod_sandbox(sandbox)
    config = configs.container_config(
        sandbox, "main", engines.busybox_image, ["sleep", "1000"], envs, mounts
    )
    container_id = containerd.create_container(sandbox_id, sandbox, config)
    try:
        containerd.start_container(container_id)
    except grpc.RpcError as e:
        return sandbox_id, container_id, e
    return sandbox_id, container_id, None


def test_allocated_container_starts_through_cri_and_is_registered(node, containerd, engines):
    admission = admit(node, "cuda")
    sandbox_id, container_id, error = start(
        containerd, engines, "default", "cuda", admission.envs, admission.mounts
    )
    assert error is None, error.details()
    status, info = containerd.container_status(container_id)
    assert status.state == cri.ContainerState.CONTAINER_RUNNING
    # The hook ran from the base runtime spec, with the CRI's pod identity annotations.
    assert info["runtimeSpec"]["hooks"]["createRuntime"][0]["args"][2] == node.hook_socket
    assert node.registered() == {container_id}  # the pause container gets no hook at all
    log = node.node.log()
    assert f"registered container {container_id} (default/cuda/main) on allocation" in log
    for mount in admission.mounts:
        assert any(m["destination"] == mount.container_path for m in info["runtimeSpec"]["mounts"])

    # Another pod's container reusing that env is refused; it never runs.
    _, thief_id, error = start(
        containerd, engines, "default", "thief", admission.envs, admission.mounts
    )
    assert error is not None
    assert "gpushare-hook: gpushare-node refused container" in error.details()
    assert "to pod default/cuda, not to pod default/thief" in error.details()
    assert containerd.container_status(thief_id)[0].state != cri.ContainerState.CONTAINER_RUNNING
    assert node.registered() == {container_id}

    # kubelet removing the pod: the poststop hook unregisters its container.
    containerd.remove_pod_sandbox(sandbox_id)
    node.node.wait_for(lambda: not node.registered(), timeout=5, what="the poststop hook")


def test_gpu_container_without_allocation_is_refused_through_cri(node, containerd, engines):
    _, container_id, error = start(
        containerd, engines, "default", "escape", {"NVIDIA_VISIBLE_DEVICES": "all"}
    )
    assert error is not None
    assert "without a gpushare allocation" in error.details()
    assert containerd.container_status(container_id)[0].state != (
        cri.ContainerState.CONTAINER_RUNNING
    )
    assert node.registered() == set()


def test_the_whole_node_path_kubelet_device_plugin_cri_hook_watchdog(node, containerd, engines):
    kubelet = node.kubelet
    kubelet.use_cri(containerd.address, containerd.log_root)
    spec = ContainerSpec("main", {MEMORY: 4, CORE: 30})
    pod = kubelet.run_pod("default", "train", [spec], engines.busybox_image, ["sleep", "1000"])
    assert pod.ok, pod.error
    container_id = pod.container_ids["main"]
    assert node.registered() == {container_id}
    [allocation] = node.node.allocations()
    assert allocation["containers"] == [container_id]
    node.node.wait_for(
        lambda: node.node.allocations()[0]["pod"] == "train", what="kubelet's PodResources owner"
    )

    pid = containerd.pid(container_id)
    node.set_usage([(pid, GPU0, 5000)])  # over the 4096 MiB quota
    start_time = time.monotonic()
    while runc_env.running(pid) and time.monotonic() - start_time < 5:
        time.sleep(0.02)
    took = time.monotonic() - start_time
    assert not runc_env.running(pid) and took < KILL_DEADLINE_SECONDS, took
    log = node.node.log()
    assert "violation (memory)" in log and f"killed process {pid}" in log
    # containerd sees its init die: the container exits, the poststop hook unregisters it.
    node.node.wait_for(
        lambda: (
            containerd.container_status(container_id)[0].state
            == cri.ContainerState.CONTAINER_EXITED
        ),
        what="containerd to see the container exit",
    )
    kubelet.stop_pod("default", "train")
    node.node.wait_for(lambda: not node.registered(), timeout=5, what="unregistration")
    assert containerd.sandboxes() == []
    assert leftover_cgroups(pod.uid) == []


def run_plain_container(containerd, engines, pod: str, runtime_handler: str):
    """A running busybox container in a new sandbox of ``runtime_handler``: (its runtime
    spec with this sandbox's and container's own IDs, pod name, UID and PIDs replaced by
    placeholders, its /proc/PID/limits)."""
    uid = new_uid()
    sandbox = configs.sandbox_config("default", pod, uid, containerd.log_root)
    sandbox_id = containerd.run_pod_sandbox(sandbox, runtime_handler=runtime_handler)
    config = configs.container_config(sandbox, "main", engines.busybox_image, ["sleep", "1000"])
    container_id = containerd.create_container(sandbox_id, sandbox, config)
    containerd.start_container(container_id)
    pid = containerd.pid(container_id)
    sandbox_pid = json.loads(
        containerd.runtime.PodSandboxStatus(
            cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True), timeout=60
        ).info["info"]
    )["pid"]
    text = json.dumps(containerd.container_status(container_id)[1]["runtimeSpec"])
    for value, placeholder in (
        (sandbox_id, "SANDBOX"),
        (container_id, "CONTAINER"),
        (uid, "UID"),
        (pod, "POD"),
        (f"/proc/{sandbox_pid}/", "/proc/SANDBOX_PID/"),
    ):
        text = text.replace(value, placeholder)
    with open(f"/proc/{pid}/limits") as f:
        limits = f.read()
    return json.loads(text), limits


def test_the_base_spec_changes_nothing_but_the_hooks(node, containerd, engines):
    """A container of the runtime with gpushare's base spec gets exactly what the same
    container gets from containerd's CRI default spec (the runtime without a base spec): the
    same rlimits, capabilities, mounts, masked and read-only paths, namespaces, devices ...,
    field by field, and the same /proc/PID/limits (open files included); only the hooks
    differ."""
    hooked, hooked_limits = run_plain_container(containerd, engines, "spec-base", "")
    plain, plain_limits = run_plain_container(
        containerd, engines, "spec-plain", containerd_harness.PLAIN_RUNTIME
    )
    assert hooked.pop("hooks")["createRuntime"][0]["args"][2] == node.hook_socket
    assert "hooks" not in plain
    assert hooked_limits == plain_limits
    for key in sorted(set(hooked) | set(plain)):
        assert hooked.get(key) == plain.get(key), key


def test_doctor_reads_the_config_the_running_containerd_was_started_with(node, containerd):
    """The private containerd runs with ``--config <its dir>/config.toml``, not
    /etc/containerd/config.toml: doctor's runtime hook check finds that file from the running
    process (its /proc/PID/cmdline), reads the base spec it names, sees the hooks calling this
    node's socket, and says which file it checked."""
    settings = load_settings(node.node.config_path)  # the daemon's own: its socket, its paths
    result = runtime_hook.check_runtime_hook(settings, Host())
    # Other containerds may run on this machine; this one's part of the answer is checked.
    where = f"containerd ({containerd.config_path}, --config of pid {containerd.process.pid})"
    launcher = os.path.join(node.install_root, "etc", "gpushare", "gpushare-hook")
    assert f"{where}: {launcher} (createRuntime, poststop; socket {node.hook_socket})" in (
        result.detail
    ), result.detail
    assert f"{where}:" not in result.detail.replace(f"{where}: {launcher} (", "")
