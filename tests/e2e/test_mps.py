"""End to end with MPS: the real gpushare-node, the test kubelet and a control
binary: the stand-in, and NVIDIA's real one (driver 535 from
standins.real_parts; without a GPU its control daemon runs and answers, no
MPS server ever starts, and nothing here needs one). Pins one control daemon per
shared card, the pipe env and mounts in Allocate, whole cards leaving MPS and
coming back, health and restart of a killed control daemon, survival of control
daemons across our own restart, and a hung or babbling control binary never
hanging the node daemon."""

import os
import shutil
import signal
import stat
import tempfile
import time

import pytest

from mps import mounts
from standins import real_parts
from standins.daemon_proc import CORE, GPU0, GPU1, MEMORY, MPS_STANDIN, WHOLE, Node
from standins.kubelet_sim import ContainerSpec, TestKubelet

pytestmark = pytest.mark.e2e


def start(node: Node) -> Node:
    node.kubelet = TestKubelet(node.device_plugin_dir, node.pod_resources_socket)
    node.kubelet.start()
    node.start()
    for resource in (MEMORY, CORE, WHOLE):
        node.kubelet.wait_for_resource(resource, timeout=30)
    return node


@pytest.fixture(params=["stand-in", "real"])
def control_binary(request) -> str:
    if request.param == "real":
        return real_parts.require().mps_control
    return MPS_STANDIN


@pytest.fixture
def node(control_binary):
    node = start(Node(control_binary))
    yield node
    node.cleanup()
    node.kubelet.stop()


def card_health(devices, card):
    return {d.health for d in devices if d.id.split("-_-")[0] == card}


def pipe_dir(node, card):
    return os.path.join(node.root, "run", "mps", card, "pipe")


def client_dir(node, card):
    return os.path.join(node.root, "run", "mps", card, "client")


def test_each_shared_card_has_its_own_control_daemon(node):
    daemons = node.wait_for(lambda: len(node.mps_daemons()) == 2 and node.mps_daemons())
    assert set(daemons) == {GPU0, GPU1}  # CUDA_VISIBLE_DEVICES of each is its card
    for card in (GPU0, GPU1):
        assert os.path.exists(os.path.join(pipe_dir(node, card), "control"))
        log = open(os.path.join(node.root, "run", "mps", card, "log", "control.log")).read()
        # The server-side ceiling: the card's shareable memory (15 GiB), read back.
        assert "Cmd:set_default_device_pinned_mem_limit 0 15360M" in log
        assert "Cmd:get_default_device_pinned_mem_limit 0" in log
    assert "compute mode EXCLUSIVE_PROCESS" in node.log()


@pytest.mark.skipif(os.geteuid() != 0, reason="a tmpfs and a mount namespace per card need root")
def test_each_cards_daemon_has_the_cards_own_tmpfs_as_dev_shm(node):
    """Each card's control daemon runs in a mount namespace of its own whose /dev/shm is
    the card's tmpfs (its /proc/PID/mountinfo shows that tmpfs on top at /dev/shm), which
    no container gets, sized by mps.shm_size_mib; the two cards' differ."""
    daemons = node.wait_for(lambda: len(node.mps_daemons()) == 2 and node.mps_daemons())
    devices = set()
    for card, pid in daemons.items():
        shm_dir = os.path.join(node.root, "run", "mps", card, "shm")
        assert mounts.top_mount(shm_dir).options.startswith("rw,size=65536k,nr_inodes=16384")
        with open(f"/proc/{pid}/mountinfo", "rb") as f:
            [*_, top] = [e for e in mounts.parse_mountinfo(f.read()) if e.mount_point == "/dev/shm"]
        assert (top.fstype, top.options) == ("tmpfs", mounts.top_mount(shm_dir).options)
        assert os.stat(f"/proc/{pid}/root/dev/shm").st_dev == os.stat(shm_dir).st_dev
        assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        devices.add(os.stat(shm_dir).st_dev)
    assert len(devices) == 2


@pytest.mark.parametrize("order", [[MEMORY, CORE], [CORE, MEMORY]])
def test_shared_container_gets_pipe_env_and_the_client_directory(node, order):
    """Both resources give the card's client directory read-only at /tmp/nvidia-mps (not
    the daemon's pipe directory, whose control_privileged lets root quit it) and nothing
    else: no /dev/shm (the container keeps its runtime's own); the client directory holds
    only the daemon's control socket."""
    result = node.kubelet.admit_pod(
        "default", "job", [ContainerSpec("main", {MEMORY: 4, CORE: 30})], order=order
    )
    assert result.ok, result.error
    container = result.containers[0]
    assert container.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    expected = {("/tmp/nvidia-mps", client_dir(node, GPU0), True)}
    for resource in order:  # both resources give the same mounts
        mounts = {
            (m.container_path, m.host_path, m.read_only)
            for m in container.responses[resource].mounts
        }
        assert mounts == expected
    assert os.listdir(client_dir(node, GPU0)) == ["control"]
    assert os.path.samefile(
        os.path.join(client_dir(node, GPU0), "control"),
        os.path.join(pipe_dir(node, GPU0), "control"),
    )


def test_whole_card_leaves_mps_and_comes_back_when_freed(node):
    kubelet = node.kubelet
    before = node.wait_for(lambda: len(node.mps_daemons()) == 2 and node.mps_daemons())
    whole = kubelet.admit_pod("default", "trainer", [ContainerSpec("main", {WHOLE: 1})])
    assert whole.ok, whole.error
    assert whole.containers[0].responses[WHOLE].mounts == []
    assert "CUDA_MPS_PIPE_DIRECTORY" not in whole.containers[0].envs
    card = whole.containers[0].envs["NVIDIA_VISIBLE_DEVICES"]
    other = GPU1 if card == GPU0 else GPU0
    node.wait_for(lambda: card not in node.mps_daemons(), what="MPS stopped on the whole card")
    assert node.mps_daemons()[other] == before[other]
    node.wait_for(lambda: "left MPS (control daemon stopped, compute mode DEFAULT)" in node.log())
    kubelet.remove_pod("default", "trainer")
    node.wait_for(lambda: card in node.mps_daemons(), what="MPS back on the freed card")
    kubelet.wait_for_devices(MEMORY, lambda ds: all(d.health == "Healthy" for d in ds))


def test_killed_control_daemon_makes_the_card_unhealthy_until_restarted(node):
    kubelet = node.kubelet
    pid = node.wait_for(lambda: node.mps_daemons().get(GPU1))
    os.kill(pid, signal.SIGKILL)
    for resource in (MEMORY, CORE):
        kubelet.wait_for_devices(
            resource,
            lambda ds: card_health(ds, GPU1) == {"Unhealthy"},
            timeout=10,
        )
    assert card_health(kubelet.devices(MEMORY), GPU0) == {"Healthy"}
    assert card_health(kubelet.devices(WHOLE), GPU1) == {"Healthy"}  # whole-card use needs no MPS
    for resource in (MEMORY, CORE):
        kubelet.wait_for_devices(
            resource,
            lambda ds: card_health(ds, GPU1) == {"Healthy"},
            timeout=15,
        )
    new_pid = node.mps_daemons()[GPU1]
    assert new_pid != pid
    assert "MPS control daemon down, its shared devices are Unhealthy" in node.log()
    assert "restarting its MPS control daemon" in node.log()


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_control_daemons_survive_our_restart_with_the_same_pid(node, how):
    before = node.wait_for(lambda: len(node.mps_daemons()) == 2 and node.mps_daemons())
    assert node.kubelet.admit_pod("default", "p", [ContainerSpec("c", {MEMORY: 2})]).ok
    node.signal(how)
    node.wait(timeout=10)
    assert node.mps_daemons() == before
    registrations = len(node.kubelet.registrations())
    node.start()
    node.wait_for(lambda: len(node.kubelet.registrations()) >= registrations + 3)
    time.sleep(1.5)  # a few health checks
    assert node.mps_daemons() == before
    assert node.log().count("adopted the running MPS control daemon") == 2
    for resource in (MEMORY, CORE):
        node.kubelet.wait_for_devices(resource, lambda ds: all(d.health == "Healthy" for d in ds))


def misbehaving_binary(body: str) -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="gs-bin-"), "nvidia-cuda-mps-control")
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body + "\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("sleep 60", "MPS control daemon not answering"),
        ("cat >/dev/null; echo '@@@ garbage @@@'", "MPS control daemon answers unexpectedly"),
    ],
)
def test_hung_or_babbling_control_binary_gives_unhealthy_cards_not_a_hung_daemon(body, expected):
    binary = misbehaving_binary(body)
    node = Node(
        mps={
            "control_binary": binary,
            "command_timeout_seconds": 1,
            "health_check_interval_seconds": 0.5,
            "shm_size_mib": 64,
        }
    )
    try:
        start(node)
        kubelet = node.kubelet
        for resource in (MEMORY, CORE):
            kubelet.wait_for_devices(resource, lambda ds: all(d.health == "Unhealthy" for d in ds))
        assert all(d.health == "Healthy" for d in kubelet.devices(WHOLE))
        node.wait_for(lambda: expected in node.log(), what=expected)
        refused = kubelet.admit_pod("default", "p", [ContainerSpec("c", {MEMORY: 1})])
        assert not refused.ok
        started = time.monotonic()
        node.signal(signal.SIGTERM)
        assert node.wait(timeout=10) == 0 and time.monotonic() - started < 5
    finally:
        node.cleanup()
        node.kubelet.stop()
        shutil.rmtree(os.path.dirname(binary), ignore_errors=True)
