"""Serve a ``socketserver`` server until stopped, without waking up to poll.

``BaseServer.serve_forever(poll_interval)`` wakes every ``poll_interval`` to look for
a shutdown request, on an idle node too. Here the serving thread blocks in ``select`` on
the listening socket and a pipe that ``stop()`` writes to, so an idle server costs
nothing. It uses the server's ``_handle_request_noblock`` (what ``serve_forever`` calls
per ready connection) and ``service_actions``; it does not close the server.
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
        self._wake.wake()

    def close(self) -> None:
        """Free the pipe of a loop that never served (``serve()`` frees it itself)."""
        self._wake.close()
