"""The OCI spec's mounts, device nodes and device-cgroup rules, with real runc (issue 14, item 7).

A container may see only its own card: its /dev/nvidia<minor> (plus the control nodes) and its
own card's MPS client directory (never a card's /dev/shm tmpfs, its MPS server's). Pins,
against the real daemon and the runtime hook: another card's MPS directory mounted at
/tmp/nvidia-mps by a container holding card 0's allocation is refused (written plainly, with
``..``, through a symlink), so are its own card's control daemon pipe directory and the whole
MPS root; a container without GPU env that has /dev/nvidia1 in linux.devices, a bind-mounted
device node of major 195, or a mount under /var/run/nvidia-container-devices is refused;
linux.resources.devices allowing another card's minor or every char device is refused. And the
devices cgroup, not the missing driver, is what stops an allowed container from opening another
card's node: it makes c 195:1 itself with mknod and opening it fails with EPERM, while its own
c 195:0 gives ENXIO (no NVIDIA driver on this machine)."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

from mps.layout import MpsLayout
from standins import runc_env
from standins.daemon_proc import GPU0, GPU1

pytestmark = pytest.mark.e2e

NVIDIA_MAJOR = 195
PIPE = "/tmp/nvidia-mps"


@pytest.fixture
def cluster():
    cluster = runc_env.EnforcementNode()
    yield cluster
    cluster.close()


@pytest.fixture
def scratch():
    """A host directory for symlinks and device nodes (removed by the node's cleanup too)."""
    path = tempfile.mkdtemp(prefix="gs-spec-", dir="/tmp")
    yield path
    subprocess.run(["rm", "-rf", path], check=False)


def layout(cluster) -> MpsLayout:
    return MpsLayout(os.path.join(cluster.node.root, "run"))


def cards(env: dict[str, str]) -> tuple[str, str]:
    """(the allocation's card, the other card)."""
    own = env["NVIDIA_VISIBLE_DEVICES"]
    return own, GPU1 if own == GPU0 else GPU0


def with_mount_source(mounts, destination: str, source: str):
    return [(d, source if d == destination else s) for d, s in mounts]


def refused(cluster, done, name: str, *fragments: str) -> None:
    assert done.returncode != 0, f"{name} started"
    for fragment in fragments:
        assert fragment in done.stdout, done.stdout
    assert name not in cluster.registered()
    state = cluster.runtime.state(name)
    assert state is None or state["status"] == "stopped"


def device(path: str, major: int, minor: int) -> dict:
    return {"path": path, "type": "c", "major": major, "minor": minor, "fileMode": 0o666,
            "uid": 0, "gid": 0}  # fmt: skip


def add_devices(*entries: dict):
    def edit(config: dict) -> None:
        config["linux"].setdefault("devices", []).extend(entries)

    return edit


def allow_rules(*rules: dict, mknod: bool = False):
    """resources.devices: runc's default deny-all, then ``rules``; CAP_MKNOD if asked."""

    def edit(config: dict) -> None:
        config["linux"]["resources"]["devices"] = [{"allow": False, "access": "rwm"}, *rules]
        if mknod:
            for kind in ("bounding", "effective", "permitted"):
                config["process"]["capabilities"][kind].append("CAP_MKNOD")

    return edit


def rule(major, minor, access="rw", type_="c") -> dict:
    entry = {"allow": True, "type": type_, "access": access}
    if major is not None:
        entry["major"] = major
    if minor is not None:
        entry["minor"] = minor
    return entry


# --- the filed cases -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "form", ["other client", "other pipe", "dotdot", "symlink", "own pipe", "mps root"]
)
def test_another_cards_mps_directory_at_the_pipe_path_is_refused(cluster, scratch, form):
    """A container holding card 0's allocation that mounts card 1's MPS client or pipe
    directory at /tmp/nvidia-mps (written plainly, with .., through a symlink), its own card's
    control daemon pipe directory, or the whole MPS root, is refused, naming the mount and the
    card; what Allocate gave it (its card's client directory) starts."""
    env, mounts = cluster.admit("pipes")
    own, other = cards(env)
    mps = layout(cluster)
    os.symlink(mps.client_dir(other), os.path.join(scratch, "client"))
    source, expected = {
        "other client": (mps.client_dir(other), other),
        "other pipe": (mps.pipe_dir(other), other),
        "dotdot": (os.path.join(mps.client_dir(own), "..", "..", other, "client"), other),
        "symlink": (os.path.join(scratch, "client"), other),
        "own pipe": (mps.pipe_dir(own), f"{own}/pipe"),
        "mps root": (mps.root, "every card's MPS"),
    }[form]
    assert os.path.isdir(source)  # the mount itself would work
    done = cluster.start_in_pod("pipes", "pipes", env, with_mount_source(mounts, PIPE, source))
    refused(cluster, done, "pipes", PIPE, expected)
    assert cluster.start_in_pod("own", "pipes", env, mounts).returncode == 0
    assert "own" in cluster.registered()


def test_nvidia1_in_linux_devices_without_gpu_env_is_refused(cluster):
    """A container without GPU env whose linux.devices makes /dev/nvidia1 (c 195:1) is
    refused: it touches a GPU without a gpushare allocation."""
    edit = add_devices(device("/dev/nvidia1", NVIDIA_MAJOR, 1))
    done = cluster.start_container("nodev", {"HOME": "/"}, edit=edit)
    refused(cluster, done, "nodev", "/dev/nvidia1", "without a gpushare allocation")


def test_bind_mounted_nvidia_node_without_gpu_env_is_refused(cluster, scratch):
    """A device node of major 195 made with mknod in a scratch dir, bind-mounted into a
    container without GPU env, is refused whatever it is called."""
    node = os.path.join(scratch, "innocent")
    os.mknod(node, 0o600 | 0o020000, os.makedev(NVIDIA_MAJOR, 1))
    done = cluster.start_container("bindnode", {"HOME": "/"}, [("/dev/innocent", node)])
    refused(cluster, done, "bindnode", "195:1", "without a gpushare allocation")


@pytest.mark.parametrize("directory", ["/var/run", "/run"])
def test_nvidia_container_devices_mount_is_refused(cluster, directory):
    """A mount at <dir>/nvidia-container-devices/<card> (the NVIDIA toolkit's volume-mount
    device list) is refused for a container without GPU env, and for one whose allocation
    holds another card."""
    destination = f"{directory}/nvidia-container-devices/{GPU1}"
    done = cluster.start_container("list", {"HOME": "/"}, [(destination, "/dev/null")])
    refused(cluster, done, "list", "nvidia-container-devices", "without a gpushare allocation")
    env, mounts = cluster.admit("listed")
    own, other = cards(env)
    mounts = [*mounts, (f"{directory}/nvidia-container-devices/{other}", "/dev/null")]
    done = cluster.start_in_pod("listed", "listed", env, mounts)
    refused(cluster, done, "listed", "nvidia-container-devices", other)


# --- device-cgroup rules ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("allowed", "fragment"),
    [
        (rule(NVIDIA_MAJOR, 1), "c 195:1"),
        (rule(NVIDIA_MAJOR, None), "c 195:*"),
        (rule(None, None), "every character device"),
        (rule(None, None, type_="a"), "every character device"),
    ],
)
def test_rules_allowing_another_card_or_every_device_are_refused(cluster, allowed, fragment):
    """linux.resources.devices that allow another card's minor, every /dev/nvidia* minor or
    every char device are refused for a container holding card 0's allocation."""
    env, mounts = cluster.admit("rules")
    done = cluster.start_in_pod(
        "rules", "rules", env, mounts, edit=allow_rules(rule(NVIDIA_MAJOR, 0), allowed)
    )
    refused(cluster, done, "rules", fragment)


def test_the_devices_cgroup_stops_another_cards_node(cluster):
    """An allowed container whose rules allow only its own card (c 195:0) makes c 195:1 with
    mknod: opening it fails with EPERM (the devices cgroup), while its own minor gives ENXIO
    (no driver here): the cgroup, not the missing driver, stops it."""
    env, mounts = cluster.admit("cgroup")
    assert cards(env)[0] == GPU0  # index 0: simulated cards' minor is their index
    edit = allow_rules(rule(NVIDIA_MAJOR, 0), mknod=True)
    done = cluster.start_in_pod("cgroup", "cgroup", env, mounts, edit=edit)
    assert done.returncode == 0, done.stdout
    script = (
        "busybox mknod /dev/own c 195 0 && busybox mknod /dev/other c 195 1 && "
        "cat /dev/own; cat /dev/other; true"
    )
    ran = subprocess.run(
        ["runc", "--root", cluster.runtime.state_root, "exec", "cgroup", "sh", "-c", script],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert "can't open '/dev/own': No such device or address" in ran.stderr
    assert "can't open '/dev/other': Operation not permitted" in ran.stderr
