"""On a machine with an NVIDIA GPU, the MPS binary, torch and root (``pytest -m gpu``):
what an MPS client needs of /dev/shm, against a control daemon started by
``mps.CardDaemon`` the way gpushare-node starts it: in the card's mount namespace, whose
/dev/shm is the card's tmpfs (mps.namespace, mps.shm).

Each client runs as a container would: in a mount namespace of its own where the run
directory is hidden under an empty tmpfs and only the card's client directory (the hard
link to ``control``) is reachable, read-only, as its pipe directory. Its /dev/shm is
either the card's tmpfs (what Allocate gave before this was measured) or a private,
empty tmpfs of its own (what a container has now: its runtime's).

Pins that the daemon and the server it starts have the card's tmpfs as /dev/shm, that a
client sharing it computes through the server and is listed as its client, and that
whatever a client with a private /dev/shm does, the daemon stays healthy and a sharing
client is served after it, and that a symbolic link a tenant plants in the card's tmpfs
under a name client or server use does not make the server touch the file it points
to. Records, for docs/gpu-tests.md, the open questions: does a
client with a private /dev/shm work (then containers need no shared /dev/shm, and one
tmpfs per allocation is possible); which files client and server make in /dev/shm; does
the server exit after its last client; does a server whose files were removed while it
was up serve a new client. Skipped, with the reason, where anything is missing."""

from __future__ import annotations

import importlib.util
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest

from mps import CardDaemon, HealthState, MpsLayout, namespace, shm
from standins.daemon_proc import unmount_under
from tests.gpu.clients import finish

pytestmark = pytest.mark.gpu

# Proves it computed on the GPU, says its PID, waits until stdin closes.
RESIDENT = """
import os, sys, torch
a = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
print("sum", int(a.sum().item()), "pid", os.getpid(), flush=True)
sys.stdin.read()
"""
RESIDENT_SUM = (1 << 20) * ((1 << 20) - 1) // 2
CLIENT_SECONDS = 120  # a client that has not computed by then is taken as hung
SHM_MIB = 1024


@pytest.fixture(scope="module")
def card_uuid():
    if os.geteuid() != 0:
        pytest.skip("mount namespaces and a tmpfs need root")
    if not shutil.which("nvidia-cuda-mps-control"):
        pytest.skip("nvidia-cuda-mps-control is not on PATH")
    if namespace.missing_tools():
        pytest.skip(f"{namespace.missing_tools()} not found (util-linux)")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (CUDA clients are torch programs)")
    from nodemgr.config.schema import GpuSettings
    from nodemgr.errors import InventoryError
    from nodemgr.inventory import open_inventory

    try:
        inventory = open_inventory(GpuSettings(backend="nvml"))
    except InventoryError as e:
        pytest.skip(f"no usable NVIDIA GPU here: {e}")
    return inventory.cards()[0].uuid


@dataclass
class Card:
    daemon: CardDaemon
    root: str  # the test's directory: run/ (what gpushare-node has) and view/
    shm_dir: str  # the card's tmpfs


@pytest.fixture
def card(card_uuid):
    """The card's daemon as gpushare-node starts it, its client directory published."""
    root = tempfile.mkdtemp(prefix="mpsshm-")
    layout = MpsLayout(os.path.join(root, "run"))
    namespace.prepare_directory(layout.namespace_dir)
    shm.mount(layout.shm_dir(card_uuid), SHM_MIB)
    daemon = CardDaemon(
        card_uuid,
        "nvidia-cuda-mps-control",
        layout.pipe_dir(card_uuid),
        layout.log_dir(card_uuid),
        timeout_seconds=20,
        client_dir=layout.client_dir(card_uuid),
        namespace=namespace.CardNamespace(
            layout.namespace_file(card_uuid), layout.shm_dir(card_uuid), 20
        ),
    )
    daemon.start()
    daemon.publish()
    yield Card(daemon, root, layout.shm_dir(card_uuid))
    if daemon.probe().state is not HealthState.DOWN:
        daemon.stop()
    unmount_under(root)
    shutil.rmtree(root, ignore_errors=True)


def start_contained(card: Card, private_shm: bool) -> subprocess.Popen:
    """A RESIDENT client in a mount namespace of its own, as a container: the client
    directory read-only at <root>/view (its CUDA_MPS_PIPE_DIRECTORY), the run directory
    under an empty tmpfs, and /dev/shm the card's tmpfs or a private empty one."""
    view = os.path.join(card.root, "view")
    os.makedirs(view, exist_ok=True)
    dev_shm = (
        "mount -t tmpfs -o size=256m,mode=1777 tmpfs /dev/shm"
        if private_shm
        else 'mount --bind "$3" /dev/shm'
    )
    script = (
        'mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" && '
        f"{dev_shm} && "
        'mount -t tmpfs tmpfs "$4" && '
        'exec "$5" -c "$6"'
    )
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": card.daemon.card_uuid,
        "CUDA_MPS_PIPE_DIRECTORY": view,
    }
    return subprocess.Popen(
        [
            "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh",
            card.daemon.client_dir, view, card.shm_dir, os.path.join(card.root, "run"),
            sys.executable,
            RESIDENT,
        ],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def computed(client: subprocess.Popen) -> int | None:
    """The client's PID once it computed the right sum; None if it failed or hung (then
    it is killed)."""
    deadline = time.monotonic() + CLIENT_SECONDS
    while time.monotonic() < deadline:
        if client.poll() is not None:
            return None
        line = _readline(client, deadline - time.monotonic())
        if line is None:
            break
        words = line.split()
        if words[:2] == ["sum", str(RESIDENT_SUM)]:
            return int(words[3])
    client.kill()
    return None


def _readline(client: subprocess.Popen, seconds: float) -> str | None:
    ready, _, _ = select.select([client.stdout], [], [], max(0.0, seconds))
    return client.stdout.readline() if ready else None


def entries(path: str) -> list[str]:
    """What is in a /dev/shm, numbers replaced by N (PIDs, counters)."""
    try:
        return sorted({re.sub(r"[0-9]+", "N", name) for name in os.listdir(path)})
    except OSError as e:
        return [f"(unreadable: {e.strerror})"]


def end(client: subprocess.Popen) -> str:
    """Close its stdin and return what it said on stderr (last line), killed if need be."""
    try:
        if client.stdin is not None:
            client.stdin.close()
            client.stdin = None  # communicate() would flush it
        _, err = client.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        client.kill()
        _, err = client.communicate()
    lines = [line for line in (err or "").splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {client.returncode}"


def the_server(daemon: CardDaemon) -> int:
    [server] = daemon.client.server_pids()
    return server


def test_a_client_sharing_the_cards_tmpfs_runs_through_the_server(card, record_property):
    """What Allocate gave before: the card's tmpfs as /dev/shm. The daemon and the server
    it starts both have that tmpfs as /dev/shm; the client computes and is the server's
    client. Records which files client and server made there, and whether the server
    exits within 15 s of its last client."""
    daemon = card.daemon
    identity = daemon.identify()
    assert identity is not None and daemon.on_card_shm(identity) is True
    client = start_contained(card, private_shm=False)
    pid = computed(client)
    assert pid is not None, end(client)
    try:
        server = the_server(daemon)
        assert pid in daemon.client.client_pids(server)
        assert os.stat(f"/proc/{server}/root/dev/shm").st_dev == shm.device(card.shm_dir)
        assert {p for p, _ in daemon.servers(identity)} == {server}
        record_property("shared_shm_entries_while_a_client_runs", entries(card.shm_dir))
    finally:
        finish(client)
    deadline = time.monotonic() + 15
    while daemon.client.server_pids() and time.monotonic() < deadline:
        time.sleep(0.5)
    record_property("server_exits_within_15s_of_its_last_client", not daemon.client.server_pids())
    record_property("shared_shm_entries_after_the_client", entries(card.shm_dir))
    assert daemon.probe().ok


def test_a_client_with_a_private_dev_shm(card, record_property):
    """The open question: a client whose /dev/shm is its own, empty tmpfs (nothing shared
    with the server). Whatever it does is recorded (works, fails and how, hangs); the daemon
    stays healthy and a client sharing the card's tmpfs is served after it."""
    daemon = card.daemon
    client = start_contained(card, private_shm=True)
    pid = computed(client)
    if pid is not None:
        server = the_server(daemon)
        listed = pid in daemon.client.client_pids(server)
        record_property("private_shm_client_entries", entries(f"/proc/{pid}/root/dev/shm"))
        finish(client)
        outcome = "computed, listed as the server's client" if listed else "computed, not listed"
    else:
        outcome = f"failed or hung: {end(client)}"
    record_property("private_dev_shm_client", outcome)
    assert daemon.probe().state in (HealthState.HEALTHY, HealthState.FAULT)
    after = start_contained(card, private_shm=False)
    assert computed(after) is not None, end(after)
    finish(after)
    assert daemon.probe().ok


def test_a_server_whose_files_were_removed_while_up(card, record_property):
    """gpushare-node empties an idle card's tmpfs only after stopping its MPS server (and
    daemon) and starting the daemon again: that path must serve a new client. Whether a
    server still up when its files are removed serves a new client is recorded."""
    daemon, shm_dir = card.daemon, card.shm_dir
    first = start_contained(card, private_shm=False)
    assert computed(first) is not None, end(first)
    finish(first)
    server_up = bool(daemon.client.server_pids())
    shm.empty(shm_dir)
    second = start_contained(card, private_shm=False)
    served = computed(second) is not None
    record_property(
        "client_after_emptying_with_the_server_up",
        "no server was up" if not server_up else ("served" if served else end(second)),
    )
    if served:
        finish(second)
    daemon.stop()  # what the supervisor does before emptying when a server is up
    shm.empty(shm_dir)
    daemon.start()
    daemon.publish()
    third = start_contained(card, private_shm=False)
    assert computed(third) is not None, end(third)
    finish(third)
    identity = daemon.identify()
    assert identity is not None and daemon.on_card_shm(identity) is True


def test_a_link_planted_in_the_cards_tmpfs_is_not_followed_by_the_server(card, record_property):
    """The server runs as its client's user with the host's file system in view and now
    shares /dev/shm with the card's tenants, who may plant symbolic links there. A client
    runs once to show which names client and server use; a link to a file outside is then
    planted under each of those names that is free again, and a second client runs: the
    file outside must be untouched. Records how many names could be planted."""
    canary = os.path.join(card.root, "canary")
    with open(canary, "w") as f:
        f.write("canary")
    first = start_contained(card, private_shm=False)
    assert computed(first) is not None, end(first)
    seen = set(os.listdir(card.shm_dir))
    finish(first)
    planted = 0
    for name in seen:
        path = os.path.join(card.shm_dir, name)
        if not os.path.lexists(path):
            os.symlink(canary, path)
            planted += 1
    record_property("links_planted_of_names_seen", f"{planted} of {len(seen)}")
    second = start_contained(card, private_shm=False)
    served = computed(second) is not None
    record_property("client_with_links_planted", "served" if served else end(second))
    if served:
        finish(second)
    assert not os.path.islink(canary)
    with open(canary) as f:
        assert f.read() == "canary"
