"""Exhaustion of the daemon's listeners: every socket it serves, flooded, while its open-file
limit is the 1024 that systemd gives a unit without LimitNOFILE=.

The node is the real gpushare-node (RLIMIT_NOFILE 1024, soft and hard, set with prlimit:
the daemon cannot raise it) with NVIDIA's real MPS control binary, the test kubelet and
real runc containers made from real Allocate responses. The main attack holds 1,200
connections to the metrics port, the one any local user reaches, and checks that a
container's process over its quota is killed, that a pod is admitted and its GPU container
started, and that a crashed MPS control daemon is started again. Then each listener (the
metrics port, the status and hook sockets, each device plugin socket) is flooded in turn
with connections that send nothing while enforcement and admission are checked, then with
clients trickling a byte at a time, a request far over its byte limit and bytes that are no
request. The DRA plugin's two sockets are flooded the same way on a second node, with
dra.enabled against the test API server and kubelet's DRA side, where a claim is prepared
through kubelet's DRA connection meanwhile, its container made from its CDI spec and its
process over the claim's memory killed, and a device plugin pod admitted. The root-only
sockets are flooded as root (a misbehaving agent: a hostile root can stop the daemon
anyway); a local user cannot connect to them at all. Each test records one row of the
table "Exhaustion" of docs/attacks.md from what it observed; the last test compares the
table with that file (``scripts/update-tables`` rewrites it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import grpc
import pytest

from hooks import protocol
from nodemgr.config.loading import load_settings
from nodemgr.dra import plugin as dra_plugin
from nodemgr.enforcement import hookserver
from nodemgr.kubelet import servicer
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2 as dp
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from nodemgr.kubelet.api import dra_v1_pb2, dra_v1_pb2_grpc
from nodemgr.kubelet.api import pluginregistration_v1_pb2 as reg
from nodemgr.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc
from nodemgr.runtime.loop import SOCKET_NAMES
from nodemgr.status import http
from nodemgr.status import server as status_server
from standins import real_parts
from standins.daemon_proc import GPU0, MEMORY, WHOLE
from standins.dra_enforcement import DraEnforcementNode
from standins.kubelet_sim import ContainerSpec
from standins.outcome_table import OutcomeTable
from tests.hostile import floods, tenant
from tests.hostile.tenant import killed_within

pytestmark = [pytest.mark.e2e, pytest.mark.outcome_table]

# How long a flood runs before the checks (unless the daemon's open files reach its limit
# first): the kernel delivers what it queued, the flood reopens what the daemon closed.
FLOOD_SETTLE_SECONDS = 10.0
# What systemd gives a unit without LimitNOFILE= (its soft limit); here soft and hard.
NOFILE = 1024
FLOOD = 1200  # connections, more than the daemon may open
TRICKLERS = 20
OVERSIZED_BYTES = 64 * 1024 * 1024
GARBAGE = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)) * 4 + b"\r\n\r\n\n"

IDLE_METRICS = (
    f"1,200 TCP connections to the metrics port (loopback: any local user) that send one "
    f"byte and then nothing, reopened as the daemon closes them; its RLIMIT_NOFILE {NOFILE}"
)
METRICS = (
    "metrics port: 1,200 connections sending one byte, 20 trickling a request a byte every "
    "0.5 s, a 64 MiB request head, bytes that are not HTTP"
)
STATUS = (
    "status socket (root only): 1,200 idle connections, 20 trickling a request, a 64 MiB "
    "request, bytes that are not JSON"
)
HOOK = (
    "hook socket (root only): 1,200 idle connections, 20 trickling a request, a 64 MiB "
    "request, bytes that are not JSON"
)
PLUGIN = {
    kind: f"{name} (root only): 1,200 idle connections, 20 trickling the HTTP/2 preface, a "
    "64 MiB Allocate, bytes that are not HTTP/2"
    for kind, name in SOCKET_NAMES.items()
}
DRA = {
    "registration": "the DRA registration socket `<driver>-reg.sock` (root only): 1,200 idle "
    "connections, 20 trickling the HTTP/2 preface, a 64 MiB NotifyRegistrationStatus, bytes "
    "that are not HTTP/2",
    "service": "the DRA service socket `dra.sock` (root only): 1,200 idle connections, 20 "
    "trickling the HTTP/2 preface, a 64 MiB NodePrepareResources, bytes that are not HTTP/2",
}
LOCAL_USER = "a local user (uid 65534) connects to the status, hook, device plugin and DRA sockets"

TABLE = OutcomeTable(
    "hostile-exhaustion",
    "tests/hostile/test_exhaustion.py",
    "docs/attacks.md",
    ("attack", "result", "what the attacker got"),
    (IDLE_METRICS, METRICS, STATUS, HOOK, *PLUGIN.values(), *DRA.values(), LOCAL_USER),
)


@pytest.fixture(scope="module")
def node_options() -> dict:
    return {"nofile": NOFILE}


@pytest.fixture(scope="module")
def dra_node():
    """A second node, with dra.enabled (the test API server, kubelet's DRA side), NVIDIA's
    real MPS control binary, runc and the same open-file limit."""
    node = DraEnforcementNode(real_parts.require().mps_control, nofile=NOFILE)
    try:
        yield node
    finally:
        node.close()


# --- what every test checks meanwhile ------------------------------------------------------


def settle(fds: floods.FdWatch) -> None:
    """Let a flood run FLOOD_SETTLE_SECONDS, or until the daemon is at its open-file limit."""
    deadline = time.monotonic() + FLOOD_SETTLE_SECONDS
    while time.monotonic() < deadline and fds.peak < NOFILE - 8:
        time.sleep(0.1)


def enforcement_and_admission_go_on(site: tenant.Site, name: str) -> str:
    """A pod admitted through the test kubelet (Allocate), its GPU container started through
    the runtime hook, and that container's process at 9,000 MiB of its 4,096 MiB quota
    killed; the row's words for it."""
    cluster = site.cluster
    site.start(name)
    init = cluster.runtime.pid(name)
    cluster.set_usage([(init, GPU0, 9000)])
    killed = killed_within(init, f"{name}: a process at 9,000 MiB of a 4,096 MiB quota")
    return f"a pod admitted, its GPU container started, its process over quota {killed}"


def metrics_address(site: tenant.Site) -> tuple[str, int]:
    host, _, port = site.status()["daemon"]["metrics_address"].rpartition(":")
    return host.strip("[]"), int(port)


def refused(site: tenant.Site, listener: str) -> dict[str, int]:
    return site.status()["daemon"]["listeners"][listener]["refused"]


@dataclass
class Attempts:
    """What a flood met, then the trickle, the oversized request and the garbage."""

    held_at_most: int  # the daemon's open files, at their peak, during everything
    trickle: floods.Trickled
    oversized: bytes | None  # what the daemon answered
    garbage: bytes


def flood_and_check(site: tenant.Site, connect: floods.Connect, name: str) -> tuple[str, int]:
    """FLOOD idle connections (each sends one byte on TCP, see floods.tcp), and meanwhile
    enforcement and admission; (their words, the daemon's peak open files)."""
    pid = site.cluster.node.process.pid
    return flood_while(pid, connect, lambda: enforcement_and_admission_go_on(site, name))


def flood_while(pid: int, connect: floods.Connect, meanwhile) -> tuple[str, int]:
    """FLOOD idle connections to daemon ``pid`` while ``meanwhile()`` runs; (what it
    returned, the daemon's peak open files)."""
    with floods.FdWatch(pid) as fds, floods.Flood(connect, FLOOD):
        went_on = meanwhile()
        peak = fds.peak
    assert peak < NOFILE, peak
    return went_on, peak


def attempts(
    site: tenant.Site | int,
    connect: floods.Connect,
    request: bytes,
    oversized: bytes | None,
    trickle_seconds: float,
) -> Attempts:
    """``oversized`` (None: none; the gRPC sockets get theirs through gRPC) and GARBAGE,
    each closed by the daemon (``site``'s, or the one of that PID), then the trickle
    (``request`` a byte every 0.5 s, TRICKLERS at once); the daemon's open files watched
    throughout."""
    pid = site if isinstance(site, int) else site.cluster.node.process.pid
    with floods.FdWatch(pid) as fds:
        too_big = None
        if oversized is not None:
            too_big, closed = floods.send_and_read(connect, oversized)
            assert closed, "the daemon kept the connection of an oversized request open"
        garbage, closed = floods.send_and_read(connect, GARBAGE)
        assert closed, "the daemon kept the connection of a request of garbage open"
        trickle = floods.trickle(connect, TRICKLERS, request, 0.5, trickle_seconds + 4.0)
        peak = fds.peak
    assert trickle.still_open == 0, trickle
    assert trickle.longest_held_seconds < trickle_seconds + 1.5, trickle
    assert peak < NOFILE, peak
    return Attempts(peak, trickle, too_big, garbage)


# --- the main attack -------------------------------------------------------------------------


@pytest.mark.timeout(900)
def test_idle_connections_to_the_metrics_port_stop_nothing(site):
    """1,200 connections to the metrics port that each send one byte and then nothing,
    each reopened when the daemon closes it, against a daemon with RLIMIT_NOFILE 1024: a
    runc container's process at 9,000 MiB of its 4,096 MiB quota is killed, a new pod is
    admitted through kubelet and its GPU container through the hook, a crashed MPS control
    daemon is started again and the card is Healthy, and the daemon stays healthy; its open
    files stay under its limit."""
    cluster = site.cluster
    cluster.wait_mps_ready()
    pid = cluster.node.process.pid
    assert floods.nofile_limit(pid) == NOFILE
    site.start("victim")
    init = cluster.runtime.pid("victim")
    site.police("victim", (init, GPU0, 100))
    host, port = metrics_address(site)
    with (
        floods.FdWatch(pid) as fds,
        floods.Flood(floods.tcp(host, port, b"G"), FLOOD, reopen=True) as flood,
    ):
        settle(fds)
        cluster.set_usage([(init, GPU0, 9000)])
        killed = killed_within(init, "a process at 9,000 MiB of a 4,096 MiB quota")
        site.start("during")  # Allocate through kubelet, the container through the hook
        new_mps = cluster.restart_daemon()
        assert site.healthy()
        peak = fds.peak
        assert flood.closed_by_daemon > FLOOD  # the cap closed them, reopened, again
    assert cluster.card_health() == {"Healthy"} and new_mps in cluster.ready_pids()
    assert peak < NOFILE, peak
    count = refused(site, "metrics")
    assert count["cap"] > 0 and count["slow"] > 0, count
    TABLE.record(
        IDLE_METRICS,
        f"at most {http.MAX_CONNECTIONS} served at once, the rest closed at once, unread; those "
        f"served closed {http.HEAD_SECONDS:g} s after connecting, no whole request having come; "
        f"the daemon's open files stayed under {NOFILE}; meanwhile a process at 9,000 MiB of "
        f"its 4,096 MiB quota {killed}, a pod admitted and its GPU container started, a "
        "crashed MPS control daemon started again (card Healthy), the daemon healthy",
        f"nothing but the {http.MAX_CONNECTIONS} metrics slots: scrapes compete with it for "
        "them; enforcement, admission and MPS went on",
    )


# --- one listener at a time --------------------------------------------------------------------


def test_the_metrics_port_keeps_to_its_budget(site):
    """Idle connections, a trickled request, a 64 MiB request head and bytes that are not
    HTTP at the metrics port: the cap holds, the trickle is cut at the head deadline, the
    oversized head is answered 431, the garbage 400; enforcement and admission go on."""
    host, port = metrics_address(site)
    went_on, _ = flood_and_check(site, floods.tcp(host, port, b"G"), "m-during")
    got = attempts(
        site,
        floods.tcp(host, port),
        b"GET /metrics HTTP/1.1\r\nHost: node-a\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * OVERSIZED_BYTES,
        http.HEAD_SECONDS,
    )
    assert got.oversized is not None and got.oversized.startswith(b"HTTP/1.0 431 ")
    assert b"400" in got.garbage, got.garbage[:200]
    count = refused(site, "metrics")
    assert count["cap"] > 0 and count["too_large"] == 1, count
    assert count["slow"] >= min(TRICKLERS, http.MAX_CONNECTIONS), count
    assert site.healthy()
    TABLE.record(
        METRICS,
        f"idle: {http.MAX_CONNECTIONS} served at once, the rest closed at once; trickling: "
        f"cut {http.HEAD_SECONDS:g} s after connecting; 64 MiB: answered 431 once "
        f"{http.MAX_HEAD_BYTES // 1024} KiB were read; not HTTP: answered 400; the daemon's "
        f"open files under {NOFILE}; meanwhile {went_on}",
        "nothing: no thread, file or memory beyond the port's budget",
    )


def test_the_status_socket_keeps_to_its_budget(site):
    """The same at the status socket (root only): the cap holds, a trickled request is cut
    at the read deadline, the oversized and the garbage are answered with an error."""
    path = os.path.join(os.path.dirname(site.cluster.hook_socket), "status.sock")
    went_on, _ = flood_and_check(site, floods.unix(path), "s-during")
    got = attempts(
        site,
        floods.unix(path),
        protocol.encode({"command": "status"}),
        b'{"command": "' + b"x" * OVERSIZED_BYTES,
        status_server.READ_TIMEOUT_SECONDS,
    )
    limit = status_server.MAX_REQUEST_BYTES
    assert got.oversized is not None and f"over {limit} bytes".encode() in got.oversized
    assert b"unreadable request" in got.garbage, got.garbage[:200]
    count = refused(site, "status")
    assert count["cap"] > 0 and count["too_large"] == 1, count
    assert count["slow"] >= min(TRICKLERS, status_server.MAX_CONNECTIONS), count
    assert site.healthy()
    TABLE.record(
        STATUS,
        f"idle: {status_server.MAX_CONNECTIONS} served at once, the rest closed at once; "
        f"trickling: cut {status_server.READ_TIMEOUT_SECONDS:g} s after connecting; 64 MiB: "
        f"an error once {limit} bytes were read; not JSON: an error; the daemon's open files "
        f"under {NOFILE}; meanwhile {went_on}",
        "nothing: `nodemgr status` answered right after",
    )


def test_the_hook_socket_keeps_to_its_budget(site):
    """The same at the runtime hook socket (root only): the cap holds, a trickled request
    is cut at the read deadline, the oversized and the garbage are refused naming why."""
    cluster = site.cluster
    went_on, _ = flood_and_check(site, floods.unix(cluster.hook_socket), "h-during")
    got = attempts(
        site,
        floods.unix(cluster.hook_socket),
        protocol.encode({"stage": "poststop", "container_id": "nobody"}),
        b'{"stage": "' + b"x" * OVERSIZED_BYTES,
        hookserver.READ_TIMEOUT_SECONDS,
    )
    limit = protocol.MAX_MESSAGE_BYTES
    assert got.oversized is not None and f"over {limit} bytes".encode() in got.oversized
    assert b"unreadable hook request" in got.garbage, got.garbage[:200]
    count = refused(site, "hook")
    assert count["cap"] > 0 and count["too_large"] == 1, count
    assert count["slow"] >= min(TRICKLERS, hookserver.MAX_CONNECTIONS), count
    assert site.healthy()
    TABLE.record(
        HOOK,
        f"idle: {hookserver.MAX_CONNECTIONS} served at once, the rest closed at once (the "
        f"hook tries again); trickling: cut {hookserver.READ_TIMEOUT_SECONDS:g} s after "
        f"connecting; 64 MiB: refused once {protocol.MAX_MESSAGE_BYTES // (1024 * 1024)} MiB "
        f"were read; not JSON: refused; the daemon's open files under {NOFILE}; meanwhile "
        f"{went_on}",
        "nothing: GPU containers admitted while it went on",
    )


@pytest.mark.parametrize("kind", list(SOCKET_NAMES))
def test_each_device_plugin_socket_keeps_to_its_budget(site, kind):
    """The same at each device plugin socket (root only, gRPC): at most MAX_CONNECTIONS
    kept, the rest closed at once; a trickled HTTP/2 preface is cut at the handshake
    deadline; a 64 MiB Allocate is refused RESOURCE_EXHAUSTED unread; garbage is closed;
    kubelet's own connection serves an Allocate meanwhile (a whole card on the whole-card
    socket), and enforcement goes on."""
    cluster = site.cluster
    path = os.path.join(cluster.node.device_plugin_dir, SOCKET_NAMES[kind])
    went_on, _ = flood_and_check(site, floods.unix(path), f"{kind.name.lower()}-during")
    whole = whole_card_admitted(site) if kind.name == "WHOLE" else ""
    attempts(
        site,
        floods.unix(path),
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        None,
        servicer.HANDSHAKE_SECONDS,
    )
    code = oversized_allocate(path)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, code
    assert site.healthy()
    TABLE.record(
        PLUGIN[kind],
        f"idle: at most {servicer.MAX_CONNECTIONS} kept, the rest closed at once; trickling: "
        f"cut {servicer.HANDSHAKE_SECONDS:g} s after connecting (HTTP/2 handshake deadline); "
        f"64 MiB: {code.name} unread (limit {servicer.MAX_RECEIVE_BYTES // (1024 * 1024)} "
        f"MiB); not HTTP/2: closed; the daemon's open files under {NOFILE}; meanwhile "
        f"{went_on}{whole}",
        "nothing: kubelet's own connection served on",
    )


def whole_card_admitted(site: tenant.Site) -> str:
    """A pod asking a whole card, admitted through kubelet's connection to the whole-card
    socket (and removed again); the row's words for it."""
    kubelet = site.cluster.kubelet
    result = kubelet.admit_pod("default", "whole", [ContainerSpec("main", {WHOLE: 1})])
    assert result.ok, result.error
    kubelet.remove_pod("default", "whole")
    return "; a whole card allocated through kubelet's connection"


def oversized_allocate(path: str) -> grpc.StatusCode:
    """An Allocate of more than 64 MiB over a connection of its own: gRPC's answer."""
    ids = [f"GPU-{i:08d}-" + "x" * 1000 for i in range(OVERSIZED_BYTES // 1000)]
    request = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)])
    options = [("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(f"unix://{path}", options=options) as channel:
        try:
            dp_grpc.DevicePluginStub(channel).Allocate(request, timeout=30)
        except grpc.RpcError as e:
            return e.code()
    raise AssertionError("an Allocate of 64 MiB was answered")


# --- the DRA plugin's sockets, on the DRA node -------------------------------------------------


def dra_goes_on(node: DraEnforcementNode, name: str) -> str:
    """A claim prepared through kubelet's DRA connection (kubelet tries a pod start again
    until it succeeds, as it does), its GPU container started from the claim's CDI spec
    through the runtime hook, that container's process at 9,000 MiB of the claim's 2 GiB
    killed, and a device plugin pod admitted; the row's words for it."""
    env, mounts = node.prepared_pod(name, f"{name}-claim", {"memory": "2Gi"}, retry_seconds=30)
    done = node.start_in_pod(name, name, env, mounts)
    assert done.returncode == 0, done.stdout
    init = node.runtime.pid(name)
    node.set_usage([(init, env["NVIDIA_VISIBLE_DEVICES"], 9000)])
    killed = killed_within(init, f"{name}: a process at 9,000 MiB of a 2 GiB claim")
    node.set_usage([])
    admitted = node.dp_admit(f"{name}-dp", {MEMORY: 1})
    assert admitted.ok, admitted.error
    return (
        "a claim prepared through kubelet's DRA connection, its GPU container started from "
        f"its CDI spec, its process over the claim's memory {killed}, and a device plugin "
        "pod admitted"
    )


def dra_status(node: DraEnforcementNode) -> dict:
    done = node.node.nodemgr("status", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def oversized_dra_call(node: DraEnforcementNode, which: str) -> grpc.StatusCode:
    """A 64 MiB call over a connection of its own to ``which`` DRA socket: gRPC's answer."""
    settings = load_settings(node.node.config_path).dra
    options = [("grpc.max_send_message_length", -1)]
    path = getattr(settings, f"{which}_socket")
    with grpc.insecure_channel(f"unix://{path}", options=options) as channel:
        try:
            if which == "registration":
                status = reg.RegistrationStatus(
                    plugin_registered=False, error="x" * OVERSIZED_BYTES
                )
                reg_grpc.RegistrationStub(channel).NotifyRegistrationStatus(status, timeout=30)
            else:
                claims = [
                    dra_v1_pb2.Claim(namespace="ns", uid=f"u{i}", name="c" * 250_000)
                    for i in range(OVERSIZED_BYTES // 250_000)
                ]
                request = dra_v1_pb2.NodePrepareResourcesRequest(claims=claims)
                dra_v1_pb2_grpc.DRAPluginStub(channel).NodePrepareResources(request, timeout=30)
        except grpc.RpcError as e:
            return e.code()
    raise AssertionError(f"a 64 MiB call to the DRA {which} socket was answered")


@pytest.mark.parametrize("which", list(DRA))
def test_each_dra_socket_keeps_to_its_budget(dra_node, which):
    """The same at the DRA plugin's registration and service sockets (root only, gRPC): at
    most MAX_CONNECTIONS kept, the rest closed at once; a trickled HTTP/2 preface cut at the
    handshake deadline; a 64 MiB call refused RESOURCE_EXHAUSTED unread; garbage closed;
    meanwhile kubelet prepares a claim through its DRA connection, the claim's container is
    policed, a device plugin pod is admitted, and the daemon stays healthy."""
    node = dra_node
    pid = node.node.process.pid
    assert floods.nofile_limit(pid) == NOFILE
    path = getattr(load_settings(node.node.config_path).dra, f"{which}_socket")
    went_on, _ = flood_while(pid, floods.unix(path), lambda: dra_goes_on(node, f"dra-{which}"))
    attempts(
        pid,
        floods.unix(path),
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        None,
        dra_plugin.HANDSHAKE_SECONDS,
    )
    code = oversized_dra_call(node, which)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, code
    daemon = dra_status(node)["daemon"]
    assert daemon["healthy"] is True and daemon["dra"]["serving"] is True, daemon
    TABLE.record(
        DRA[which],
        f"idle: at most {dra_plugin.MAX_CONNECTIONS} kept, the rest closed at once; trickling: "
        f"cut {dra_plugin.HANDSHAKE_SECONDS:g} s after connecting (HTTP/2 handshake deadline); "
        f"64 MiB: {code.name} unread (limit {dra_plugin.MAX_RECEIVE_BYTES // 1024} KiB); not "
        f"HTTP/2: closed; the daemon's open files under {NOFILE}; meanwhile {went_on}",
        "nothing: kubelet's DRA calls served on",
    )


# --- authentication: who can connect at all ---------------------------------------------------

AS_NOBODY = textwrap.dedent(
    """\
    import socket, sys
    for path in sys.argv[1:]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            print(path, "connected")
        except OSError as e:
            print(path, type(e).__name__)
        finally:
            s.close()
    """
)


def test_a_local_user_cannot_connect_to_the_root_only_sockets(site, dra_node):
    """As uid 65534 (what any local user or non-root hostNetwork pod is), connecting to the
    status, hook, device plugin and DRA sockets is refused by the file system (0600, root);
    the metrics port is the one listener it reaches (the main attack)."""
    cluster = site.cluster
    run = os.path.dirname(cluster.hook_socket)
    dra = load_settings(dra_node.node.config_path).dra
    paths = [
        cluster.hook_socket,
        os.path.join(run, "status.sock"),
        *(os.path.join(cluster.node.device_plugin_dir, n) for n in SOCKET_NAMES.values()),
        dra.registration_socket,
        dra.service_socket,
    ]
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         AS_NOBODY, *paths],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    said = dict(line.rsplit(" ", 1) for line in done.stdout.splitlines())
    assert said == dict.fromkeys(paths, "PermissionError"), said
    modes = {oct(os.stat(p).st_mode & 0o777) for p in paths}
    assert modes == {"0o600"}, modes
    TABLE.record(
        LOCAL_USER,
        f"refused by the file system ({len(paths)} of {len(paths)}: PermissionError; each "
        "socket 0600, root's)",
        "nothing: only the metrics port is reachable, and it has its budget",
    )


def test_docs_table_says_what_was_observed():
    """After a complete run, the table in docs/attacks.md is what this module observed."""
    if not TABLE.complete:
        missing = [c for c in TABLE.expected_cases if c not in TABLE.rows]
        pytest.skip(f"partial run, the docs table is not judged (no row for {missing})")
    problem = TABLE.check_or_update()
    assert problem is None, problem
