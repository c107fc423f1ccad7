"""The status socket (``<run_dir>/status.sock``, root-only) that ``nodemgr status`` reads.

One request per connection: ``{"command": "status"}`` in, the status document (or
``{"error": "..."}``) out, one JSON line each. ``LiveStatus`` gathers the live state for
it and for the metrics; it never changes anything. Its budget: docs/operations.md, ``nodemgr
status``, and :mod:`nodemgr.common.unixserver`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hooks import protocol
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.common.connbudget import ListenerStats
from nodemgr.common.unixserver import UnixServer, refusal_reason
from nodemgr.domain.isolation import NodeIsolationFacts, WatchdogFacts
from nodemgr.domain.statusdoc import MpsView, UsageView, build_status
from nodemgr.enforcement.registry import ContainerRegistry
from nodemgr.errors import GpushareError

log = logging.getLogger(__name__)

READ_TIMEOUT_SECONDS = 2.0  # in all, not per read
MAX_REQUEST_BYTES = 4096  # {"command": "status"} is 22 bytes
MAX_CONNECTIONS = 16  # nodemgr status, doctor, an agent: one at a time each
DEADLINE_SECONDS = 30.0  # a 64 MiB answer to a slow reader included
MAX_ANSWER_BYTES = 64 * 1024 * 1024  # a node with thousands of allocations still fits
CARDS_META_KEY = "cards"  # for `nodemgr status` with the daemon down
# Absent from the workers: taken as down (fail closed).
WATCHDOG_WORKER = "watchdog"


@dataclass
class DaemonFacts:
    version: str
    pid: int = field(default_factory=os.getpid)
    started_at: float = field(default_factory=time.time)
    ready: bool = False  # every resource registered with kubelet and MPS healthy
    registered: bool = False  # every resource registered with the current kubelet
    metrics_address: str | None = None  # as bound; None when off or failed
    # Workers.health
    worker_health: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None
    # nodemgr.dra.plugin.DraPlugin.state; None: DRA not enabled.
    dra: Callable[[], Mapping[str, Any]] | None = None
    # ConnectionBudget.stats by listener
    listener_stats: Callable[[], Mapping[str, ListenerStats]] | None = None


class LiveStatus:
    def __init__(
        self,
        node: str,
        facts: DaemonFacts,
        allocator: Allocator,
        ledger: Ledger,
        registry: ContainerRegistry,
        mps_views: Callable[[], dict[str, MpsView]] | None,
        usage: Callable[[], UsageView | None],
        enforcement: Callable[[], dict],
        dmem_regions: Mapping[str, str] | None = None,
    ):
        self.node = node
        self.facts = facts
        self._allocator = allocator
        self._ledger = ledger
        self._registry = registry
        self._mps_views = mps_views
        self._usage = usage
        self._enforcement = enforcement
        self._dmem_regions = dict(dmem_regions or {})

    def remember_cards(self) -> None:
        cards = [
            {"index": c.index, "uuid": c.uuid, "name": c.name, "memory_mib": c.memory_mib}
            for c in self._allocator.cards
        ]
        self._ledger.set_meta(CARDS_META_KEY, json.dumps(cards))

    def document(self) -> dict:
        containers: dict[str, int] = {}
        for registration in self._registry.registrations():
            containers[registration.allocation_id] = (
                containers.get(registration.allocation_id, 0) + 1
            )
        try:
            violations = self._ledger.violation_counts()
        except GpushareError as e:
            log.warning("status: cannot count violations: %s", e)
            violations = {}
        facts = self.facts
        workers = {} if facts.worker_health is None else dict(facts.worker_health())
        listeners = {} if facts.listener_stats is None else dict(facts.listener_stats())
        problems = [
            f"{name}: not running" if not w["up"] else f"{name}: {w['problem']}"
            for name, w in sorted(workers.items())
            if not w["up"] or w.get("problem")
        ]
        usage, enforcement = self._usage(), self._enforcement()
        watchdog = WatchdogFacts(
            running=bool(workers.get(WATCHDOG_WORKER, {}).get("up")),
            action=enforcement.get("action"),
            usage_readable=usage is not None,
        )
        return build_status(
            self.node,
            self._allocator.cards,
            self._allocator.allocations(),
            source="daemon",
            card_problems=self._allocator.card_problems(),
            mps=None if self._mps_views is None else self._mps_views(),
            usage=usage,
            containers=containers,
            violations=violations,
            enforcement=enforcement,
            isolation=NodeIsolationFacts(watchdog, self._dmem_regions),
            daemon={
                "pid": facts.pid,
                "version": facts.version,
                "started_at": facts.started_at,
                "uptime_seconds": round(time.time() - facts.started_at, 3),
                "ready": facts.ready,
                "registered": facts.registered,
                "metrics_address": facts.metrics_address,
                "healthy": not problems,
                "problems": problems,
                "workers": workers,
                **({} if facts.dra is None else {"dra": dict(facts.dra())}),
                "listeners": listeners,
            },
        )


class StatusServer(UnixServer):
    def __init__(self, status: LiveStatus, socket_path: str):
        super().__init__(
            socket_path, self._handle, "status-server", MAX_CONNECTIONS, DEADLINE_SECONDS
        )
        self._status = status

    def start(self) -> None:
        super().start()
        log.info("status socket ready at %s", self.socket_path)

    def _handle(self, sock: socket.socket) -> None:
        try:
            request = protocol.read_message(
                sock, MAX_REQUEST_BYTES, deadline=time.monotonic() + READ_TIMEOUT_SECONDS
            )
            if request.get("command") != "status":
                answer = {"error": f"unknown command {request.get('command')!r} (known: status)"}
            else:
                answer = self._status.document()
        except (protocol.ProtocolError, OSError) as e:
            reason = refusal_reason(e)
            if reason is not None and not self.budget.was_cut(sock):  # a cut counts already
                self.budget.refuse(reason)
            answer = {"error": f"unreadable request ({e})"}
        except Exception as e:  # a bug must answer, not leave the operator hanging
            log.exception("status request failed")
            answer = {"error": f"internal error in gpushare-node ({e}); see its log"}
        try:
            sock.settimeout(DEADLINE_SECONDS)  # the deadline cuts a slow reader before
            sock.sendall(protocol.encode(answer))
        except OSError:
            pass  # the client gave up


def query(socket_path: str, timeout_seconds: float = 5.0) -> dict:
    """OSError or protocol.ProtocolError when the daemon cannot answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_seconds)
        sock.connect(socket_path)
        sock.sendall(protocol.encode({"command": "status"}))
        answer = protocol.read_message(sock, MAX_ANSWER_BYTES)
    if "error" in answer:
        raise protocol.ProtocolError(f"gpushare-node answered: {answer['error']}")
    return answer
