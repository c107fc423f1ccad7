"""docs/security.md's listener table against the sockets the running processes listen on.

The real gpushare-node with every listener on (metrics, status, hook, the three device
plugin sockets, and DRA with the test API server and kubelet's DRA side), the MPS
control daemons it starts (NVIDIA's real binary where this machine has it, else the
stand-in) and the real gpushare-scheduler with its TLS material and health port. Each
process's sockets are read from the kernel (standins.listeners: its /proc/PID/fd
socket inodes against its network namespace's unix, TCP, UDP and netlink tables, unix
sockets known by their file through sock_diag) and named by what the config and the
extender's flags say is there.

Pins: every socket these processes listen on has a row (a listener that cannot be named,
or a socket of a kind that cannot be judged, fails too), every row has a socket, in the
process the row names; and who can reach each one is what its row says: as uid 65534 a
connect (or, for the netlink socket, a send) to a `root only` listener is refused, to
any other it goes through. The status document lists the daemon's own listeners with
the caps its open-file check counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

from nodemgr.config.loading import load_settings
from nodemgr.enforcement.procevents import CN_IDX_PROC, NETLINK_CONNECTOR
from nodemgr.runtime.loop import SOCKET_NAMES
from nodemgr.runtime.wiring import listener_caps
from standins import listeners, real_parts
from standins.daemon_proc import MPS_STANDIN
from standins.dra_node import DraCluster
from standins.extender_proc import ExtenderProc
from standins.paths import REPO

pytestmark = pytest.mark.e2e

DOC = os.path.join(REPO, "docs", "security.md")
PLUGIN_NAMES = {kind: f"device-plugin-{kind.name.lower()}" for kind in SOCKET_NAMES}


@dataclass(frozen=True)
class Seen:
    """A listener found on a running process, and the name this test gives it."""

    name: str | None  # None: nothing on the node should listen there
    process: str
    pid: int
    listener: listeners.Listener


@pytest.fixture(scope="module")
def node():
    parts = real_parts.find()
    binary = parts.mps_control if isinstance(parts, real_parts.RealParts) else MPS_STANDIN
    cluster = DraCluster(control_binary=binary)
    extender = None
    try:
        cluster.start()
        extender = ExtenderProc(cluster.api.write_kubeconfig(cluster.node.root + "/extender"))
        extender.wait_ready()
        yield cluster, extender
    finally:
        if extender is not None:
            extender.stop()
        cluster.close()


def names(cluster: DraCluster, extender: ExtenderProc) -> tuple[dict, dict]:
    """(unix file key -> listener name, (kind, address) -> listener name) for this node, from
    its config and the extender's ports."""
    settings = load_settings(cluster.node.config_path)
    paths = {
        "hook": settings.hook_socket,
        "status": settings.status_socket,
        "dra-registration": settings.dra.registration_socket,
        "dra-service": settings.dra.service_socket,
    }
    for kind, name in PLUGIN_NAMES.items():
        paths[name] = os.path.join(settings.kubelet.device_plugin_dir, SOCKET_NAMES[kind])
    files = {listeners.file_key(path): name for name, path in paths.items()}
    for card in cluster.node.mps_daemons():
        pipe = os.path.join(settings.run_dir, "mps", card, "pipe")
        files[listeners.file_key(os.path.join(pipe, "control"))] = "mps-control"
        privileged = os.path.join(pipe, "control_privileged")
        files[listeners.file_key(privileged)] = "mps-control-privileged"
    done = cluster.node.nodemgr("status", "--json")
    assert done.returncode == 0, done.stderr
    host, _, port = json.loads(done.stdout)["daemon"]["metrics_address"].rpartition(":")
    addresses = {
        ("tcp", (host.strip("[]"), int(port))): "metrics",
        ("tcp", ("127.0.0.1", extender.port)): "extender-https",
        ("tcp", ("127.0.0.1", extender.health_port)): "extender-health",
        ("netlink", (NETLINK_CONNECTOR, 1 << (CN_IDX_PROC - 1))): "proc-events",
    }
    return files, addresses


def observed(cluster: DraCluster, extender: ExtenderProc) -> list[Seen]:
    files, addresses = names(cluster, extender)
    processes = [("gpushare-node", cluster.node.process.pid)]
    processes += [("nvidia-cuda-mps-control", pid) for pid in cluster.node.mps_daemons().values()]
    processes.append(("gpushare-scheduler", extender.process.pid))
    seen, unknown = [], {}
    for process, pid in processes:
        sockets = listeners.sockets_of(pid)
        if sockets.unknown:
            unknown[f"{process} ({pid})"] = sockets.unknown
        for found in sockets.listeners:
            table = files if found.kind == "unix" else addresses
            key = found.where if found.kind == "unix" else (found.kind, found.where)
            seen.append(Seen(table.get(key), process, pid, found))
    assert not unknown, f"sockets of a kind this test cannot judge: {unknown}"
    return seen


def test_every_listener_has_a_row_and_every_row_a_listener(node):
    """Each socket the daemon, its MPS control daemons and the extender listen on is named,
    and has a row of docs/security.md's listener table naming its process; each row's
    listener is found on the node."""
    cluster, extender = node
    rows = listeners.listener_table(open(DOC).read())
    seen = observed(cluster, extender)
    unnamed = [s for s in seen if s.name is None]
    assert not unnamed, (
        "listening, but nothing on the node should be (or this test does not know it yet: "
        f"name it in names() and give it a row in docs/security.md): {unnamed}"
    )
    without_row = sorted({s.name for s in seen} - set(rows))
    assert not without_row, f"listeners without a row in docs/security.md: {without_row}"
    not_found = sorted(set(rows) - {s.name for s in seen})
    assert not not_found, f"rows of docs/security.md whose listener is not there: {not_found}"
    wrong_process = sorted(
        {
            (s.name, s.process)
            for s in seen
            if not rows[s.name]["process and code"].startswith(s.process)
        }
    )
    assert not wrong_process, (
        f"listeners found in another process than their row says: {wrong_process}"
    )


AS_NOBODY = textwrap.dedent(
    """\
    import json, socket, sys
    said = {}
    for kind, where in json.loads(sys.argv[1]):
        try:
            if kind == "unix":
                s = socket.socket(socket.AF_UNIX, where[1])
                s.connect(where[0])
            elif kind == "tcp":
                s = socket.create_connection(tuple(where), timeout=5)
            else:
                s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, where[0])
                s.sendto(bytes(20), (where[1], 0))
            s.close()
            said[repr(where)] = "reached"
        except OSError as e:
            said[repr(where)] = type(e).__name__
    print(json.dumps(said))
    """
)


def _netlink_port(pid: int, inode: int) -> int:
    """The port id of process ``pid``'s netlink socket ``inode``."""
    with open(f"/proc/{pid}/net/netlink") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if int(fields[9]) == inode:
                return int(fields[2])
    raise AssertionError(f"no netlink socket {inode} of {pid}")


def test_who_can_reach_each_listener_is_what_the_table_says(node):
    """As uid 65534 (any local user, a non-root hostNetwork pod): every listener whose row
    says `root only` refuses it (the socket's own file mode: the directories above it are
    opened to everyone first; for the netlink socket, the kernel), and every other
    listener lets it in."""
    cluster, extender = node
    rows = listeners.listener_table(open(DOC).read())
    settings = load_settings(cluster.node.config_path)
    by_key = {}
    for found in observed(cluster, extender):
        if found.listener.kind == "unix":
            path = _path_of(found.name, settings, cluster)
            _searchable_down_to(path, cluster.node.root)
            target = ("unix", [path, found.listener.type])
        elif found.listener.kind == "tcp":
            target = ("tcp", list(found.listener.where))
        else:
            target = (
                "netlink",
                [NETLINK_CONNECTOR, _netlink_port(found.pid, found.listener.inode)],
            )
        by_key[found.name] = target
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         AS_NOBODY, json.dumps(list(by_key.values()))],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    said = json.loads(done.stdout)
    outcome = {name: said[repr(where)] for name, (_, where) in by_key.items()}
    expected = {
        name: "PermissionError"
        if rows[name]["who can reach it"].startswith("root only")
        else "reached"
        for name in by_key
    }
    assert outcome == expected


def _path_of(name: str, settings, cluster: DraCluster) -> str:
    """A path of the unix listener ``name`` (one card's, for the MPS sockets)."""
    plugin = {v: k for k, v in PLUGIN_NAMES.items()}
    if name in plugin:
        return os.path.join(settings.kubelet.device_plugin_dir, SOCKET_NAMES[plugin[name]])
    if name.startswith("mps-control"):
        card = sorted(cluster.node.mps_daemons())[0]
        leaf = "control_privileged" if name.endswith("privileged") else "control"
        return os.path.join(settings.run_dir, "mps", card, "pipe", leaf)
    return {
        "hook": settings.hook_socket,
        "status": settings.status_socket,
        "dra-registration": settings.dra.registration_socket,
        "dra-service": settings.dra.service_socket,
    }[name]


def _searchable_down_to(path: str, root: str) -> None:
    """Let everyone through each directory from ``root`` down to ``path``'s (the test's
    node lives in a 0700 temporary directory, which would refuse any socket in it)."""
    directory = os.path.dirname(path)
    chain = []
    while directory.startswith(root):
        chain.append(directory)
        directory = os.path.dirname(directory)
    for directory in chain:
        os.chmod(directory, os.stat(directory).st_mode & 0o7777 | 0o001)


def test_the_status_document_shows_each_listener_of_the_daemon_with_its_cap(node):
    """`nodemgr status --json` lists every listener of the daemon's own (the DRA sockets
    with dra.enabled) with the connection cap the open-file check counts."""
    cluster, _ = node
    done = cluster.node.nodemgr("status", "--json")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)["daemon"]["listeners"]
    caps = listener_caps(load_settings(cluster.node.config_path))
    assert {name: listener["max_connections"] for name, listener in shown.items()} == caps
    assert {"dra-registration", "dra-service"} <= set(caps)
