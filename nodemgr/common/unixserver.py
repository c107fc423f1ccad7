"""A root-only unix stream socket served by a thread: one request, one answer.

Shared by the runtime hook socket and the status socket. The socket file is
0600 (only root, i.e. the container runtime and the operator, may talk to the
daemon): it is bound, chmod-ed, and only then listened on, so nobody can
connect while its mode is wider (no process-wide umask change, which would
race with other threads creating files). A stale file left by a killed
daemon is replaced, and ``stop`` removes it. It follows the worker lifecycle
of :mod:`nodemgr.common.workers`. ``handle(sock)`` reads the request and writes the answer;
it must catch its own errors (an exception here only closes the connection).

A client must not hold the server: each listener has a budget
(:class:`~nodemgr.common.connbudget.ConnectionBudget`): at most ``max_connections`` served
at once (one over the cap is closed at once, unread; a hook client tries again), and each
connection cut ``deadline_seconds`` after it was accepted, whatever its handler is doing.
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
    """Serves a connection in its own thread while under the cap; closes it otherwise."""

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
        """``max_connections`` served at once; each connection is cut ``deadline_seconds``
        after it was accepted, whatever its handler is doing."""
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
            os.unlink(self.socket_path)  # left by a killed daemon; nobody serves it
        handle = self._handle

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                handle(self.request)

        server = _Server(self.socket_path, Handler, self.budget)
        try:
            server.server_bind()
            os.chmod(self.socket_path, SOCKET_MODE)  # before listen: no one connects until then
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
        """Stop accepting: the socket file is removed and the serving thread told to end, at
        once (``join`` waits for it), so servers stop side by side."""
        if self._server is None or self._stopped:
            return
        self._stopped = True
        try:
            os.unlink(self.socket_path)  # no new client finds us from now on
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
        """Connections cut at their deadline."""
        return self.budget.refused(DEADLINE)

    def stats(self) -> ListenerStats:
        return self.budget.stats()


def refusal_reason(error: Exception) -> str | None:
    """Why a request of the hook protocol (hooks.protocol, which the status socket speaks
    too) could not be read: the reason the listener's refusals are counted under; None
    for a client that closed before sending anything (nothing to refuse)."""
    if isinstance(error, protocol.ClosedError):
        return None
    if isinstance(error, TimeoutError):
        return SLOW
    if isinstance(error, protocol.TooLargeError):
        return TOO_LARGE
    return MALFORMED
