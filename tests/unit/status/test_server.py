"""Pins nodemgr.status.server, the status socket ``nodemgr status`` reads: a status request
is answered with the live document (cards, allocations, the containers registered on
each, the daemon's own facts); an unknown command or an unreadable request is answered
with an error, never a hang; a bug while building the document is answered as an
internal error; ``query`` returns the document and raises on an error answer; the card
list is kept in the ledger for when the daemon is down; the daemon section names each worker,
up or down, and is not ``healthy`` while one is down or has a problem (``problems`` says
why); the socket keeps to its budget (request size, whole-request read time, connection
cap); each allocation's isolation follows the
live watchdog (worker up, action, per-process memory readable) and the kernel facts given."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from hooks import protocol
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import ContainerRef
from nodemgr.domain.statusdoc import MpsView, UsageView
from nodemgr.enforcement.registry import ContainerRegistry
from nodemgr.errors import LedgerError
from nodemgr.inventory import open_inventory
from nodemgr.status import server as server_module
from nodemgr.status.server import CARDS_META_KEY, DaemonFacts, LiveStatus, StatusServer, query
from standins.cards import GPU0, GPU1, MPS_PIPE, env_of, simulated_settings

MEM, CORE = ResourceKind.MEMORY, ResourceKind.CORE


class Node:
    def __init__(self, tmp_path, socket_dir):
        self.settings = simulated_settings(str(tmp_path))
        self.ledger = Ledger(self.settings.state_dir)
        cards = open_inventory(self.settings.gpus).cards()
        self.allocator = Allocator(self.settings, cards, self.ledger)
        self.registry = ContainerRegistry(self.ledger, self.allocator, MPS_PIPE)
        self.facts = DaemonFacts(version="1.2.3", pid=4242, started_at=1000.0)
        self.facts.ready = self.facts.registered = True
        self.document_error: BaseException | None = None
        self.status = LiveStatus(
            "node-a",
            self.facts,
            self.allocator,
            self.ledger,
            self.registry,
            lambda: {GPU0: MpsView("healthy", clients=1)},
            lambda: None,
            lambda: {"action": "kill"},
        )
        self.server = StatusServer(self.status, os.path.join(socket_dir, "status.sock"))

    def allocate(self, memory_units=4, core_percent=30):
        allocation_id = None
        for kind, size in ((MEM, memory_units), (CORE, core_percent)):
            held = {key for a in self.allocator.allocations() for key in a.device_pairs()}
            available = [d.id for d in self.allocator.devices(kind) if (kind, d.id) not in held]
            ids = self.allocator.preferred(kind, available, [], size)
            allocation_id = self.allocator.allocate(kind, ids).allocation_id
        return self.allocator.allocation(allocation_id)

    def ask(self, raw: bytes) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(self.server.socket_path)
            sock.sendall(raw)
            return protocol.read_message(sock, 64 * 1024 * 1024)


@pytest.fixture
def node(tmp_path):
    # Unix socket paths must stay under 108 bytes; pytest's tmp_path may not.
    socket_dir = tempfile.mkdtemp(dir="/tmp", prefix="gs-status-")
    node = Node(tmp_path, socket_dir)
    node.server.start()
    yield node
    node.server.stop()
    node.ledger.close()
    shutil.rmtree(socket_dir, ignore_errors=True)


@pytest.fixture
def child():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def test_the_status_request_is_answered_with_the_live_document(node, child):
    """query() gets the document: node, source, both cards, the allocation with the count
    of containers registered on it, MPS state and the daemon's facts."""
    allocation = node.allocate()
    identity = ContainerRef("ml", "train-0", "main")
    assert node.registry.admit("c1", child.pid, env_of(allocation), identity, "0::/c1\n")[0]
    document = query(node.server.socket_path)
    assert (document["node"], document["source"]) == ("node-a", "daemon")
    assert [g["uuid"] for g in document["gpus"]] == [GPU0, GPU1]
    assert document["gpus"][0]["mps"] == {"state": "healthy", "clients": 1, "detail": ""}
    [row] = document["allocations"]
    assert (row["id"], row["memory_mib"], row["core_percent"], row["containers"]) == (
        allocation.id,
        4096,
        30,
        1,
    )
    daemon = document["daemon"]
    assert (daemon["pid"], daemon["version"], daemon["started_at"]) == (4242, "1.2.3", 1000.0)
    assert daemon["ready"] is True and daemon["registered"] is True
    assert daemon["uptime_seconds"] > 0


def test_an_unknown_command_is_answered_with_an_error(node):
    """A command other than status: an error naming it and the known ones."""
    answer = node.ask(protocol.encode({"command": "stop"}))
    assert answer == {"error": "unknown command 'stop' (known: status)"}


@pytest.mark.parametrize("raw", [b"status please\n", b"[1, 2]\n"])
def test_an_unreadable_request_is_answered_with_an_error(node, raw):
    """Bytes that are not a JSON object: an 'unreadable request' error, not a hang."""
    assert node.ask(raw)["error"].startswith("unreadable request (")


def test_a_bug_while_building_the_document_is_answered(node, monkeypatch):
    """The document cannot be built: the operator gets an internal error pointing to the
    log, and the server keeps serving."""

    def broken():
        raise RuntimeError("status bug")

    monkeypatch.setattr(node.status, "document", broken)
    answer = node.ask(protocol.encode({"command": "status"}))
    assert answer == {"error": "internal error in gpushare-node (status bug); see its log"}
    monkeypatch.undo()
    assert query(node.server.socket_path)["node"] == "node-a"


def test_query_raises_on_an_error_answer(node, monkeypatch):
    """query() turns the daemon's error answer into a ProtocolError quoting it."""
    monkeypatch.setattr(node.status, "document", lambda: {"error": "busy"})
    with pytest.raises(protocol.ProtocolError, match="gpushare-node answered: busy"):
        query(node.server.socket_path)


def test_query_without_a_daemon_raises_oserror(tmp_path):
    """No socket: OSError (nodemgr status then reads the ledger instead)."""
    with pytest.raises(FileNotFoundError):
        query(str(tmp_path / "status.sock"), timeout_seconds=1)


def test_violations_that_cannot_be_counted_do_not_fail_the_document(node, monkeypatch):
    """The ledger failing to count violations still gives a document (with none)."""

    def broken():
        raise LedgerError("cannot read the ledger")

    monkeypatch.setattr(node.ledger, "violation_counts", broken)
    document = node.status.document()
    assert document["node"] == "node-a"


def test_the_card_list_is_kept_in_the_ledger(node):
    """remember_cards writes index, UUID, model and memory of each card for ``nodemgr
    status`` to show while the daemon is down."""
    node.status.remember_cards()
    cards = json.loads(Ledger(node.settings.state_dir).get_meta(CARDS_META_KEY))
    assert cards == [
        {"index": 0, "uuid": GPU0, "name": "Tesla T4", "memory_mib": 15360},
        {"index": 1, "uuid": GPU1, "name": "Tesla T4", "memory_mib": 15360},
    ]


def test_the_socket_is_root_only_and_removed_at_stop(node):
    """The status socket is 0600 and gone after stop."""
    assert os.stat(node.server.socket_path).st_mode & 0o777 == 0o600
    node.server.stop()
    assert not os.path.exists(node.server.socket_path)


def test_the_daemon_section_names_each_worker_and_whether_all_are_up(node):
    """The daemon section says, per worker, whether it is up, its restarts and its last
    failure, and ``healthy`` is false while any is down (nodemgr status --json)."""
    health = {
        "watchdog": {"up": False, "restarts": 5, "failure": "UnicodeDecodeError: bad byte"},
        "hook-server": {"up": True, "restarts": 0, "failure": None},
    }
    node.facts.worker_health = lambda: health
    daemon = query(node.server.socket_path)["daemon"]
    assert daemon["workers"] == health
    assert daemon["healthy"] is False
    health["watchdog"]["up"] = True
    assert query(node.server.socket_path)["daemon"]["healthy"] is True


def test_a_worker_with_a_problem_makes_the_daemon_unhealthy_and_says_why(node):
    """A running worker that cannot do its job (the watchdog unable to judge): ``healthy``
    false and ``problems`` names it and why; a dead worker is named too; the listeners'
    budgets are in the daemon section."""
    why = "enforcement cannot judge: cannot read /proc: Too many open files"
    health = {
        "watchdog": {"up": True, "restarts": 0, "failure": None, "problem": why},
        "hook-server": {"up": False, "restarts": 0, "failure": None, "problem": None},
    }
    node.facts.worker_health = lambda: health
    node.facts.listener_stats = lambda: {"status": node.server.stats()}
    daemon = query(node.server.socket_path)["daemon"]
    assert daemon["healthy"] is False
    assert daemon["problems"] == ["hook-server: not running", f"watchdog: {why}"]
    assert daemon["listeners"]["status"]["max_connections"] == server_module.MAX_CONNECTIONS
    health["watchdog"]["problem"] = None
    health["hook-server"]["up"] = True
    daemon = query(node.server.socket_path)["daemon"]
    assert (daemon["healthy"], daemon["problems"]) == (True, [])


def test_a_request_over_its_limit_is_refused_unread(node):
    """A 16 MiB request is answered with an error once MAX_REQUEST_BYTES are read (the
    rest is never read) and counted as too large; the socket serves on."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(node.server.socket_path)
        try:
            sock.sendall(b'{"command": "' + b"x" * (16 * 1024 * 1024))
        except OSError:
            pass  # closed under it
        answer = protocol.read_message(sock)
    assert f"over {server_module.MAX_REQUEST_BYTES} bytes" in answer["error"]
    assert node.server.stats()["refused"]["too_large"] == 1
    assert query(node.server.socket_path)["node"] == "node-a"


def test_a_trickled_request_is_cut_at_the_read_deadline_in_all(node):
    """A client sending its request a byte every 0.5 s (each in time for a per-read
    timeout) is answered with an error READ_TIMEOUT_SECONDS after it connected."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(node.server.socket_path)
        started = time.monotonic()
        answer = None
        for byte in b'{"command": "status"}':
            sock.sendall(bytes([byte]))
            sock.settimeout(0.5)
            try:
                answer = protocol.read_message(sock)
                break
            except TimeoutError:
                continue
        took = time.monotonic() - started
    assert answer is not None and "unreadable request" in answer["error"], answer
    assert took < server_module.READ_TIMEOUT_SECONDS + 1.0, took
    assert node.server.stats()["refused"]["slow"] == 1


def test_idle_connections_over_the_cap_are_closed_at_once(node):
    """MAX_CONNECTIONS idle connections are held; the next one is closed at once, unread;
    once the held ones are cut (nothing came within the read time), status answers."""
    held = []
    for _ in range(server_module.MAX_CONNECTIONS):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(node.server.socket_path)
        held.append(sock)
    deadline = time.monotonic() + 5
    while node.server.stats()["connections"] < server_module.MAX_CONNECTIONS:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as extra:
        extra.settimeout(1)
        extra.connect(node.server.socket_path)
        assert extra.recv(10) == b""
    assert node.server.stats()["refused"]["cap"] == 1
    for sock in held:
        sock.close()
    assert query(node.server.socket_path)["node"] == "node-a"


def test_isolation_follows_the_live_watchdog_and_the_kernel_facts(node):
    """The document's isolation is computed from the watchdog as it is at each request:
    enforced while its worker is up, it kills and per-process memory is readable;
    advisory when the worker is down (or not reported at all) or memory unreadable;
    watched with action log. A dmem region given for the card is named."""
    allocation = node.allocate()
    state = {"usage": UsageView({}, {}), "action": "kill", "watchdog_up": True}
    live = LiveStatus(
        "node-a",
        node.facts,
        node.allocator,
        node.ledger,
        node.registry,
        lambda: {card: MpsView("healthy", clients=1) for card in (GPU0, GPU1)},
        lambda: state["usage"],
        lambda: {"action": state["action"], "violations": {}, "kills": 0},
        dmem_regions={allocation.cards[0]: "drm/0000:03:00.0/vram0"},
    )

    def memory() -> tuple[str, str]:
        isolation = live.document()["allocations"][0]["isolation"]
        return isolation["memory"], isolation["memory_detail"]

    assert memory()[0] == "advisory"  # no worker health reported: the watchdog is not vouched for
    node.facts.worker_health = lambda: {
        "watchdog": {"up": state["watchdog_up"], "restarts": 0, "failure": None}
    }
    level, detail = memory()
    assert level == "enforced" and "drm/0000:03:00.0/vram0" in detail
    state["watchdog_up"] = False
    assert memory()[0] == "advisory"
    state["watchdog_up"], state["usage"] = True, None
    assert memory()[0] == "advisory"
    state["usage"], state["action"] = UsageView({}, {}), "log"
    assert memory()[0] == "watched"
    assert live.document()["allocations"][0]["isolation"]["compute"] == "advisory"
