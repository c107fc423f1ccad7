"""A root-only unix stream socket served by a thread: one request, one answer.

Shared by the runtime hook socket and the status socket. The socket file is
0600 (only root, i.e. the container runtime and the operator, may talk to the
daemon): it is bound, chmod-ed, and only then listened on, so nobody can
connect while its mode is wider (no process-wide umask change, which would
race with other threads creating files). A stale file left by a killed
daemon is replaced, and ``stop`` removes it. It follows the worker lifecycle
of :mod:`nodemgr.common.workers`. ``handle(sock)`` reads the request and writes the answer;
it must catch its own errors (an exception here only closes the connection).

A client must not hold the server: every connection has a total deadline (one thread
cuts it with ``shutdown``, which ends any recv or send the handler is blocked in, so a
client trickling a byte at a time is cut however the handler reads), and at most
``max_connections`` are served at once; one over the cap is closed at once, unread
(a hook client tries again), counted, and logged once per burst.
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any

from nodemgr.common.serveloop import ServeLoop

log = logging.getLogger(__name__)

SOCKET_MODE = 0o600
# Defaults: a request and its answer take milliseconds; these bound hostile clients.
MAX_CONNECTIONS = 32
DEADLINE_SECONDS = 30.0


class _Deadlines:
    """Cuts each registered connection at its deadline: one thread for all of them."""

    def __init__(self, name: str):
        self._name = name
        self._cond = threading.Condition()
        self._due: dict[socket.socket, float] = {}
        self._stopped = False
        self.cut = 0  # connections cut at their deadline
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add(self, sock: socket.socket, deadline: float) -> None:
        with self._cond:
            self._due[sock] = deadline
            self._cond.notify()

    def remove(self, sock: socket.socket) -> None:
        """Before the socket is closed: it is never touched after this returns."""
        with self._cond:
            self._due.pop(sock, None)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def join(self, timeout_seconds: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout_seconds)

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                for sock in [s for s, due in self._due.items() if due <= now]:
                    del self._due[sock]
                    self.cut += 1
                    try:
                        sock.shutdown(socket.SHUT_RDWR)  # the handler's recv/send ends now
                    except OSError:
                        pass  # the client closed it already
                next_due = min(self._due.values(), default=None)
                self._cond.wait(None if next_due is None else max(next_due - now, 0.001))


class _Server(socketserver.ThreadingUnixStreamServer):
    """Serves a connection in its own thread while under the cap; closes it otherwise."""

    daemon_threads = True

    def __init__(self, path: str, handler: type, owner: UnixServer):
        super().__init__(path, handler, bind_and_activate=False)
        self._owner = owner

    def process_request(self, request: Any, client_address: Any) -> None:
        owner = self._owner
        if not owner._enter():
            self.shutdown_request(request)
            return
        owner._deadlines.add(request, time.monotonic() + owner.deadline_seconds)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.shutdown_request(request)
            owner._leave()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._owner._leave()

    def shutdown_request(self, request: Any) -> None:
        self._owner._deadlines.remove(request)  # before the close: the fd may be reused
        super().shutdown_request(request)


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
        self.max_connections = max_connections
        self.deadline_seconds = deadline_seconds
        self._deadlines = _Deadlines(f"{name}-deadlines")  # replaced at each start
        self._count_lock = threading.Lock()
        self._active = 0
        self._refused = 0  # connections closed over the cap, in all
        self._burst = 0  # of those, since a connection was last served
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

        self._deadlines = _Deadlines(f"{self.name}-deadlines")
        server = _Server(self.socket_path, Handler, self)
        try:
            server.server_bind()
            os.chmod(self.socket_path, SOCKET_MODE)  # before listen: no one connects until then
            server.server_activate()
        except BaseException:
            server.server_close()
            raise
        self._server = server
        self._stopped = False
        self._deadlines.start()
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
        self._deadlines.stop()

    def join(self, timeout_seconds: float) -> bool:
        """Wait for the serving thread to end, then close the listening socket."""
        if self._server is None:
            return True
        if self._thread is not None:
            self._thread.join(max(timeout_seconds, 0.0))
            if self._thread.is_alive():
                return False
        self._deadlines.join(timeout_seconds)
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
    def refused_connections(self) -> int:
        """Connections closed unread because ``max_connections`` were being served."""
        with self._count_lock:
            return self._refused

    @property
    def cut_connections(self) -> int:
        """Connections cut at their deadline."""
        return self._deadlines.cut

    def _enter(self) -> bool:
        """Whether a new connection may be served (then it counts as served until
        ``_leave``); False over the cap, which is counted and logged once per burst."""
        with self._count_lock:
            served = self._active < self.max_connections
            if served:
                self._active += 1
                ended, self._burst = self._burst, 0
            else:
                self._refused += 1
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
        return served

    def _leave(self) -> None:
        with self._count_lock:
            self._active -= 1
