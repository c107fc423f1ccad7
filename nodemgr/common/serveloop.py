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

import selectors
import socketserver

from nodemgr.common.wakepipe import WakePipe


class ServeLoop:
    def __init__(self, server: socketserver.BaseServer):
        self._server = server
        self._wake = WakePipe()

    def serve(self) -> None:
        """Accept and dispatch connections until ``stop()``; then close the pipe."""
        server = self._server
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(server.fileno(), selectors.EVENT_READ)  # type: ignore[attr-defined]
                selector.register(self._wake.fileno(), selectors.EVENT_READ)
                while True:
                    ready = {key.fd for key, _ in selector.select()}
                    if self._wake.fileno() in ready:
                        return
                    server._handle_request_noblock()  # type: ignore[attr-defined]
                    server.service_actions()
        finally:
            self._wake.close()

    def stop(self) -> None:
        """End ``serve()`` now (from another thread); harmless when it already ended."""
        self._wake.wake()

    def close(self) -> None:
        """Free the pipe of a loop that never served (``serve()`` frees it itself)."""
        self._wake.close()
