"""Serve a ``socketserver`` server until stopped, without waking up to poll.

``BaseServer.serve_forever(poll_interval)`` wakes every ``poll_interval`` to
look for a shutdown request: with the status, hook and metrics sockets that
was 40 wake-ups a second on an idle node, each a few tens of microseconds of
Python. Here the serving thread blocks in ``select`` on the listening socket
and a pipe; ``stop()`` writes to the pipe, so the thread ends at once and an
idle server costs nothing.

Only the server's ``_handle_request_noblock`` (what ``serve_forever`` calls
for each ready connection, part of socketserver since Python 2) and
``service_actions`` are used; the server is not closed here.
"""

from __future__ import annotations

import os
import selectors
import socketserver
import threading


class ServeLoop:
    def __init__(self, server: socketserver.BaseServer):
        self._server = server
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()  # a late stop() never writes into a reused fd
        self._closed = False

    def serve(self) -> None:
        """Accept and dispatch connections until ``stop()``; then close the pipe."""
        server = self._server
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(server.fileno(), selectors.EVENT_READ)  # type: ignore[attr-defined]
                selector.register(self._wake_read, selectors.EVENT_READ)
                while True:
                    ready = {key.fd for key, _ in selector.select()}
                    if self._wake_read in ready:
                        return
                    server._handle_request_noblock()  # type: ignore[attr-defined]
                    server.service_actions()
        finally:
            self._close()

    def stop(self) -> None:
        """End ``serve()`` now (from another thread); harmless when it already ended."""
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._wake_write, b"x")
            except BlockingIOError:  # a wake is pending already
                pass

    def close(self) -> None:
        """Free the pipe of a loop that never served (``serve()`` frees it itself)."""
        self._close()

    def _close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._wake_read)
                os.close(self._wake_write)
