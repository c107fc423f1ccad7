"""docs/security.md against the code, without running anything (the running processes are
checked by tests/e2e/test_security_doc.py).

Pins:
- every module of nodemgr/, mps/ and hooks/ that binds, listens on or serves a socket
  (a gRPC port, a socketserver or wsgiref server, an asyncio or socket server, a
  socket bound to an address tuple, ``listen``) is named in the listener table, so a new
  listener in the code cannot go without a row;
- each listener's budget cell says the numbers the code holds (connection caps,
  deadlines, byte limits), so a changed constant cannot leave the page stale;
- every pytest node id the page names (``path::test_name``) is a test defined in that
  file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hooks import protocol, specfacts
from nodemgr.dra import plugin as dra_plugin
from nodemgr.enforcement import hookserver, procevents, watchdog
from nodemgr.extender import listener as extender_listener
from nodemgr.extender import server as extender_server
from nodemgr.extender.wire import Limits
from nodemgr.kubelet import servicer
from nodemgr.status import http
from nodemgr.status import server as status_server
from standins.listeners import listener_table, resolved
from standins.paths import REPO

ROOT = Path(REPO)
DOC = ROOT / "docs" / "security.md"

# What makes a module a listener's: a server bound or served, or a socket bound to an
# address (a tuple, as for TCP, UDP and netlink) or listening.
LISTENING = re.compile(
    r"add_(?:in)?secure_port\(|serve_root_only\(|create_server\(|make_server\("
    r"|\b(?:Threading)?(?:Unix)?(?:Stream|Datagram|TCP|UDP|HTTP|WSGI)Server\b"
    r"|\.bind\(\(|\.listen\("
)


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, str]]:
    return listener_table(DOC.read_text())


def listening_modules() -> dict[str, str]:
    """Module path -> the first line that makes it a listener's, over nodemgr, mps, hooks."""
    found = {}
    for package in ("nodemgr", "mps", "hooks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for line in path.read_text().splitlines():
                code = line.split("#", 1)[0]
                if LISTENING.search(code):
                    found[path.relative_to(ROOT).as_posix()] = line.strip()
                    break
    return found


def test_the_pattern_finds_the_listeners_known_today():
    """The scan is not blind: it finds the modules that make today's listeners (so a row
    it requires can only be missing, never unfindable)."""
    found = listening_modules()
    for module in (
        "nodemgr/kubelet/rootsocket.py",
        "nodemgr/common/unixserver.py",
        "nodemgr/status/http.py",
        "nodemgr/extender/listener.py",
        "nodemgr/enforcement/procevents.py",
    ):
        assert module in found, (module, sorted(found))


def test_every_module_that_listens_is_named_in_the_listener_table(rows):
    """A module that binds or serves a socket is named in some row's "process and code"."""
    named = " ".join(row["process and code"] for row in rows.values())
    missing = {m: line for m, line in listening_modules().items() if f"`{m}`" not in named}
    assert not missing, (
        "modules that listen but no row of docs/security.md's listener table names them "
        f"(add a row, and the listener to tests/e2e/test_security_doc.py): {missing}"
    )


def _numbers(name: str) -> list[str]:
    """What ``name``'s budget cell must say, from the code's constants."""
    https = extender_listener.Budget(max_body_bytes=Limits().max_body_bytes)
    health = extender_server.HEALTH_BUDGET
    plugin = [
        f"{servicer.MAX_CONNECTIONS} connections",
        f"{servicer.HANDSHAKE_SECONDS:g} s for the HTTP/2 handshake",
        f"{servicer.IDLE_SECONDS:g} s",
        f"{servicer.MAX_STREAMS} calls per connection",
        f"{servicer.MAX_CALLS} per server",
        f"{servicer.MAX_RECEIVE_BYTES // 2**20} MiB",
        f"{servicer.MAX_METADATA_BYTES // 1024} KiB",
    ]
    dra = [
        f"{dra_plugin.MAX_CONNECTIONS} connections",
        f"{dra_plugin.HANDSHAKE_SECONDS:g} s for the HTTP/2 handshake",
        f"{dra_plugin.IDLE_SECONDS:g} s",
        f"{dra_plugin.MAX_STREAMS} calls per connection",
        f"{dra_plugin.MAX_CALLS} per server",
        f"{dra_plugin.MAX_RECEIVE_BYTES // 1024} KiB",
        f"{dra_plugin.MAX_METADATA_BYTES // 1024} KiB",
    ]
    return {
        "metrics": [
            f"{http.MAX_CONNECTIONS} connections",
            f"queues {http.LISTEN_BACKLOG}",
            f"{http.HEAD_SECONDS:g} s",
            f"{http.MAX_HEAD_BYTES // 1024} KiB",
            f"{http.DEADLINE_SECONDS:g} s from accept to close",
        ],
        "status": [
            f"{status_server.MAX_CONNECTIONS} connections",
            f"{status_server.READ_TIMEOUT_SECONDS:g} s",
            f"{status_server.MAX_REQUEST_BYTES:,} bytes",
            f"{status_server.DEADLINE_SECONDS:g} s from accept to close",
        ],
        "hook": [
            f"{hookserver.MAX_CONNECTIONS} connections",
            f"{hookserver.READ_TIMEOUT_SECONDS:g} s",
            f"{protocol.MAX_MESSAGE_BYTES // 2**20} MiB",
            f"{specfacts.MAX_ENTRIES:,} mounts",
            f"{hookserver.DEADLINE_SECONDS:g} s from accept to close",
            f"{hookserver.ANSWER_TIMEOUT_SECONDS:g} s to write the answer",
        ],
        "device-plugin-memory": plugin,
        "device-plugin-core": plugin,
        "device-plugin-whole": plugin,
        "dra-registration": dra,
        "dra-service": [
            *dra,
            f"{dra_plugin.MAX_CLAIMS} claims",
            f"less {dra_plugin.DEADLINE_MARGIN_SECONDS:g} s",
        ],
        "proc-events": [
            f"{procevents._RECEIVE_BUFFER_BYTES // 2**20} MiB",
            f"more than {watchdog.MAX_EXECS_JUDGED} execs",
        ],
        "extender-https": [
            f"{https.max_connections} authenticated connections",
            f"{https.max_pending} TLS handshakes",
            f"{https.handshake_seconds:g} s each",
            f"{https.header_seconds:g} s for a request's line and headers",
            f"{https.max_header_bytes // 1024} KiB",
            f"{https.body_seconds:g} s for its body",
            f"{https.idle_seconds:g} s idle",
            f"{extender_listener.LARGE_BODY_BYTES // 2**20} MiB",
            f"{Limits().max_body_bytes // 2**20} MiB for {Limits().max_nodes:,} nodes",
            f"{https.workers} worker threads",
        ],
        "extender-health": [
            f"{health.max_connections} connections",
            f"{health.idle_seconds:g} s until it starts",
            f"{health.header_seconds:g} s for its head",
            f"{health.max_header_bytes:,} bytes",
            f"{health.write_seconds:g} s to write the answer",
            f"{health.workers} worker thread",
        ],
    }.get(name, [])


def test_each_budget_says_the_numbers_of_the_code(rows):
    """Each listener's budget cell (an "as `other`" resolved) holds its caps, deadlines and
    byte limits as the code's constants give them."""
    wrong = {}
    for name in rows:
        budget = resolved(rows, name, "budget")
        absent = [n for n in _numbers(name) if n not in budget]
        if absent:
            wrong[name] = absent
    assert not wrong, f"budget cells of docs/security.md without the code's numbers: {wrong}"


def test_the_budget_check_covers_every_listener_of_our_code(rows):
    """Every listener of gpushare-node and gpushare-scheduler has numbers checked (NVIDIA's
    MPS daemon has no budget of its own to check)."""
    ours = [n for n, row in rows.items() if not row["process and code"].startswith("nvidia")]
    assert [n for n in ours if not _numbers(n)] == []


NODE_ID = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def test_every_test_the_page_names_exists():
    """Each ``path::test_name`` on the page is a test function defined in that file."""
    text = DOC.read_text()
    missing = []
    for path, name in sorted(set(NODE_ID.findall(text))):
        source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
        if not re.search(rf"^(?:async )?def {name}\(", source, re.MULTILINE):
            missing.append(f"{path}::{name}")
    assert not missing, f"tests named in docs/security.md that do not exist: {missing}"
