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


class UnixServer:
    def __init__(self, socket_path: str, handle: Callable[[socket.socket], None], name: str):
        self.socket_path = socket_path
        self._handle = handle
        self.name = name
        self._server: socketserver.ThreadingUnixStreamServer | None = None
        self._thread: threading.Thread | None = None

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
            target=server.serve_forever, args=(0.2,), name=self.name, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server = None
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    def join(self, timeout_seconds: float) -> bool:
        """``stop`` already waited for the serving thread: nothing is left to wait for."""
        return self._server is None

    @property
    def alive(self) -> bool:
        return self._server is not None and self._thread is not None and self._thread.is_alive()
