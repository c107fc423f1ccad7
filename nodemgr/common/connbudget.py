"""A listener's budget: how many connections it serves at once, and for how long each.

The metrics port and the status and hook sockets serve clients the daemon does not
control with a thread per connection. Without a budget, a local user holding
connections open takes a thread and a file descriptor each, until none are left for
the watchdog, MPS supervision and the ledger. :class:`ConnectionBudget` keeps a listener
to its budget:

- at most ``max_connections`` at once; one over the cap is closed unread (a real
  client tries again), counted, and logged once per burst (the log must not become
  the flood);
- each served connection is cut ``deadline_seconds`` after it was accepted: one thread
  ``shutdown``s the socket, ending any recv or send its handler is blocked in, so
  trickling a byte at a time does not help. It waits without a timeout while no
  connection is open;
- handlers count other refusals (too large, too slow, malformed) with ``refuse``.

:class:`BudgetedServer` puts a ``socketserver`` threading server on a budget. What this
module must not do: read or answer requests (the handlers do).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from typing import Any, TypedDict

log = logging.getLogger(__name__)

# Why a listener closed a connection without serving it whole (the metric's reason label).
CAP = "cap"  # over the connection cap: closed at once, unread
DEADLINE = "deadline"  # still open at its deadline: cut
SLOW = "slow"  # the request did not arrive whole within its read time
TOO_LARGE = "too_large"  # the request is over its byte limit
MALFORMED = "malformed"  # the bytes are not a request of the listener's protocol
REASONS = (CAP, DEADLINE, SLOW, TOO_LARGE, MALFORMED)


class ListenerStats(TypedDict):
    """One listener as the status document and the metrics show it."""

    connections: int | None  # served now; None: not known (gRPC does not tell)
    max_connections: int
    deadline_seconds: float | None  # None: no per-connection deadline (gRPC streams)
    refused: dict[str, int]  # by reason (REASONS), since start


class ConnectionBudget:
    def __init__(self, name: str, max_connections: int, deadline_seconds: float):
        if max_connections < 1 or deadline_seconds <= 0:
            raise ValueError(f"{name}: a budget needs a cap >= 1 and a deadline > 0")
        self.name = name
        self.max_connections = max_connections
        self.deadline_seconds = deadline_seconds
        self._lock = threading.Lock()
        self._active = 0
        self._refused: Counter[str] = Counter()
        self._burst = 0  # connections closed over the cap since one was last served
        self._cond = threading.Condition()
        self._due: dict[socket.socket, float] = {}
        self._cut: set[socket.socket] = set()  # cut at their deadline, not forgotten yet
        self._stopped = False
        self._thread: threading.Thread | None = None

    # --- the deadline thread's lifecycle (with the listener's) --------------------------

    def start(self) -> None:
        """Start cutting connections at their deadlines (once per listener start)."""
        with self._cond:
            self._stopped = False
            self._due.clear()
        self._thread = threading.Thread(
            target=self._cut_at_deadlines, name=f"{self.name}-deadlines", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def join(self, timeout_seconds: float) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(max(timeout_seconds, 0.0))

    # --- one connection -----------------------------------------------------------------

    def enter(self, sock: socket.socket) -> bool:
        """Whether a newly accepted connection may be served (until ``leave``); False:
        over the cap, the caller closes it at once."""
        with self._lock:
            served = self._active < self.max_connections
            if served:
                self._active += 1
                ended, self._burst = self._burst, 0
            else:
                self._refused[CAP] += 1
                self._burst += 1
                ended = 0
            burst_began = not served and self._burst == 1
        if burst_began:
            log.warning(
                "%s: %d connections open, its connection cap: closing new ones at once, "
                "unread, until one ends (a client holding connections open?)",
                self.name,
                self.max_connections,
            )
        if ended:
            log.info(
                "%s: closed %d connections over the cap of %d; serving again",
                self.name,
                ended,
                self.max_connections,
            )
        if served:
            with self._cond:
                self._due[sock] = time.monotonic() + self.deadline_seconds
                self._cond.notify()
        return served

    def forget(self, sock: socket.socket) -> None:
        """Before the socket is closed: the deadline thread never touches it after this."""
        with self._cond:
            self._due.pop(sock, None)
            self._cut.discard(sock)

    def was_cut(self, sock: socket.socket) -> bool:
        """Whether the connection was cut at its deadline (its reads end as if the client
        closed it: a handler must not count it again)."""
        with self._cond:
            return sock in self._cut

    def leave(self) -> None:
        with self._lock:
            self._active -= 1

    def refuse(self, reason: str) -> None:
        """Count a connection closed without a whole answer for ``reason`` (REASONS)."""
        if reason not in REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        with self._lock:
            self._refused[reason] += 1

    # --- what other threads read ------------------------------------------------------------

    @property
    def connections(self) -> int:
        with self._lock:
            return self._active

    def refused(self, reason: str) -> int:
        with self._lock:
            return self._refused[reason]

    def stats(self) -> ListenerStats:
        with self._lock:
            return {
                "connections": self._active,
                "max_connections": self.max_connections,
                "deadline_seconds": self.deadline_seconds,
                "refused": {reason: self._refused[reason] for reason in REASONS},
            }

    def _cut_at_deadlines(self) -> None:
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                for sock in [s for s, due in self._due.items() if due <= now]:
                    del self._due[sock]
                    self._cut.add(sock)
                    with self._lock:
                        self._refused[DEADLINE] += 1
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # the client closed it already
                next_due = min(self._due.values(), default=None)
                self._cond.wait(None if next_due is None else max(next_due - now, 0.001))


class BudgetedServer:
    """Mixin before a ``socketserver`` ``ThreadingMixIn`` server."""

    budget: ConnectionBudget

    def process_request(self, request: Any, client_address: Any) -> None:
        budget = self.budget
        if not budget.enter(request):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # type: ignore[misc]
        except BaseException:
            self.shutdown_request(request)
            budget.leave()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)  # type: ignore[misc]
        finally:
            self.budget.leave()

    def shutdown_request(self, request: Any) -> None:
        self.budget.forget(request)  # before the close: the descriptor may be reused
        super().shutdown_request(request)  # type: ignore[misc]
