"""A root-only unix stream socket served by a thread: one request, one answer.

Shared by the runtime hook socket and the status socket. The socket file is
0600 (only root, i.e. the container runtime and the operator, may talk to the
daemon): it is bound, chmod-ed, and only then listened on, so nobody can
connect while its mode is wider (no process-wide umask change, which would
race with other threads creating files). A stale file left by a killed
daemon is replaced, and ``stop`` removes it. It follows the worker lifecycle
of :mod:`nodemgr.common.workers`. ``handle(sock)`` reads the request and writes the answer;
it must catch its own errors (an exception here only closes the connection).
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

SOCKET_MODE = 0o600
# How often the serving thread looks for a stop (the most a stop waits for it).
POLL_SECONDS = 0.1


class UnixServer:
    def __init__(self, socket_path: str, handle: Callable[[socket.socket], None], name: str):
        self.socket_path = socket_path
        self._handle = handle
        self.name = name
        self._server: socketserver.ThreadingUnixStreamServer | None = None
        self._thread: threading.Thread | None = None
        self._stopping: threading.Thread | None = None  # runs the server's shutdown

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.socket_path), mode=0o755, exist_ok=True)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # left by a killed daemon; nobody serves it
        handle = self._handle

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                handle(self.request)

        server = socketserver.ThreadingUnixStreamServer(
            self.socket_path, Handler, bind_and_activate=False
        )
        try:
            server.server_bind()
            os.chmod(self.socket_path, SOCKET_MODE)  # before listen: no one connects until then
            server.server_activate()
        except BaseException:
            server.server_close()
            raise
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, args=(POLL_SECONDS,), name=self.name, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting: the socket file is removed at once; the serving thread ends
        within its poll interval (``join`` waits for it), so servers stop side by side."""
        server = self._server
        if server is None or self._stopping is not None:
            return
        try:
            os.unlink(self.socket_path)  # no new client finds us from now on
        except FileNotFoundError:
            pass
        self._stopping = threading.Thread(
            target=server.shutdown, name=f"{self.name}-stop", daemon=True
        )
        self._stopping.start()

    def join(self, timeout_seconds: float) -> bool:
        """Wait for the serving thread to end, then close the listening socket."""
        if self._server is None:
            return True
        if self._thread is not None:
            self._thread.join(max(timeout_seconds, 0.0))
            if self._thread.is_alive():
                return False
        if self._stopping is not None:
            self._stopping.join()  # shutdown() returns as soon as the serving thread ended
        self._server.server_close()
        self._server = None
        return True

    @property
    def alive(self) -> bool:
        return (
            self._server is not None
            and self._stopping is None
            and self._thread is not None
            and self._thread.is_alive()
        )
