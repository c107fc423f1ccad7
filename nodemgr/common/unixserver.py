"""A root-only unix stream socket served by a thread: one request, one answer.

The hook and status sockets. The file is 0600 (only root: the container runtime and
the operator): bound, chmod-ed, and only then listened on, so nobody connects while its
mode is wider (a umask change would race with other threads). A stale file left by a
killed daemon is replaced; ``stop`` removes it. ``handle(sock)`` reads the request and
writes the answer, catching its own errors (an exception only closes the connection).
Each listener has a :class:`~nodemgr.common.connbudget.ConnectionBudget`.
"""

from __future__ import annotations

import os
import socket
import socketserver
import threading
from collections.abc import Callable

from hooks import protocol
from nodemgr.common.connbudget import (
    CAP,
    DEADLINE,
    MALFORMED,
    SLOW,
    TOO_LARGE,
    BudgetedServer,
    ConnectionBudget,
    ListenerStats,
)
from nodemgr.common.serveloop import ServeLoop

SOCKET_MODE = 0o600
# Defaults: a request and its answer take milliseconds; these bound hostile clients.
MAX_CONNECTIONS = 32
DEADLINE_SECONDS = 30.0


class _Server(BudgetedServer, socketserver.ThreadingUnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, handler: type, budget: ConnectionBudget):
        super().__init__(path, handler, bind_and_activate=False)
        self.budget = budget


class UnixServer:
    def __init__(
        self,
        socket_path: str,
        handle: Callable[[socket.socket], None],
        name: str,
        max_connections: int = MAX_CONNECTIONS,
        deadline_seconds: float = DEADLINE_SECONDS,
    ):
        self.socket_path = socket_path
        self._handle = handle
        self.name = name
        self.budget = ConnectionBudget(name, max_connections, deadline_seconds)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._loop: ServeLoop | None = None
        self._stopped = False

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.socket_path), mode=0o755, exist_ok=True)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # left by a killed daemon
        handle = self._handle

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                handle(self.request)

        server = _Server(self.socket_path, Handler, self.budget)
        try:
            server.server_bind()
            os.chmod(self.socket_path, SOCKET_MODE)  # before listen
            server.server_activate()
        except BaseException:
            server.server_close()
            raise
        self._server = server
        self._stopped = False
        self.budget.start()
        self._loop = ServeLoop(server)
        self._thread = threading.Thread(target=self._loop.serve, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Remove the socket file and tell the serving thread to end; returns at once."""
        if self._server is None or self._stopped:
            return
        self._stopped = True
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        if self._loop is not None:
            self._loop.stop()
        self.budget.stop()

    def join(self, timeout_seconds: float) -> bool:
        """Wait for the serving thread to end, then close the listening socket."""
        if self._server is None:
            return True
        if self._thread is not None:
            self._thread.join(max(timeout_seconds, 0.0))
            if self._thread.is_alive():
                return False
        self.budget.join(timeout_seconds)
        self._server.server_close()
        self._server = None
        return True

    @property
    def alive(self) -> bool:
        return (
            self._server is not None
            and not self._stopped
            and self._thread is not None
            and self._thread.is_alive()
        )

    @property
    def max_connections(self) -> int:
        return self.budget.max_connections

    @property
    def deadline_seconds(self) -> float:
        return self.budget.deadline_seconds

    @property
    def refused_connections(self) -> int:
        """Connections closed unread because ``max_connections`` were being served."""
        return self.budget.refused(CAP)

    @property
    def cut_connections(self) -> int:
        return self.budget.refused(DEADLINE)

    def stats(self) -> ListenerStats:
        return self.budget.stats()


def refusal_reason(error: Exception) -> str | None:
    """The refusal reason for a hook-protocol read error; None for a client that closed
    before sending anything."""
    if isinstance(error, protocol.ClosedError):
        return None
    if isinstance(error, TimeoutError):
        return SLOW
    if isinstance(error, protocol.TooLargeError):
        return TOO_LARGE
    return MALFORMED
