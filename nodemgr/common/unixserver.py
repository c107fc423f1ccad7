"""A root-only unix stream socket served by a thread: one request, one answer.

Shared by the runtime hook socket and the status socket. The socket file is
created 0600 (only root, i.e. the container runtime and the operator, may
talk to the daemon), a stale file left by a killed daemon is replaced, and
``stop`` removes it. ``handle(sock)`` reads the request and writes the answer;
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


class UnixServer:
    def __init__(self, socket_path: str, handle: Callable[[socket.socket], None], name: str):
        self.socket_path = socket_path
        self._handle = handle
        self._name = name
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

        old_umask = os.umask(0o177)  # the socket is created 0600
        try:
            self._server = socketserver.ThreadingUnixStreamServer(self.socket_path, Handler)
        finally:
            os.umask(old_umask)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.2,), name=self._name, daemon=True
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
