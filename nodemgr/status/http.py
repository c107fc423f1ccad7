"""The metrics endpoint's HTTP server: bound to one address, served by one thread.

wsgiref with a thread per request (a slow scraper holds up nobody), no DNS
lookup at bind, no request log, and bind failures translated into one
sentence saying which address and what to do. It follows the worker
lifecycle of :mod:`nodemgr.common.workers`. What it must not do: know what
the metrics are (``nodemgr.status.metrics`` hands it a WSGI app).
"""

from __future__ import annotations

import errno
import socket
import socketserver
import threading
from typing import Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import WSGIApplication

from nodemgr.common.serveloop import ServeLoop
from nodemgr.errors import BindError


def bind_wsgi(address: str, app: WSGIApplication) -> MetricsServer:
    """A server for ``app`` bound to ``host:port`` (``[v6]:port``; port 0 = any free port).

    Raises BindError, saying which address and why, when it cannot be bound.
    """
    host, port = split_host_port(address)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
            0
        ][0]
    except socket.gaierror as e:
        raise BindError(
            f"cannot serve metrics on {address}: {host} is not an address of this node "
            f"({e.strerror}); set metrics.address"
        ) from e
    server_class = type("_Server", (ThreadingServer,), {"address_family": family})
    try:
        httpd: WSGIServer = make_server(host, port, app, server_class, QuietHandler)
    except OSError as e:
        raise BindError(f"cannot serve metrics on {address}: {_why(e)}") from e
    server = MetricsServer(httpd)
    server.url_host_port = join_host_port(host, server.port)
    return server


class MetricsServer:
    """The running endpoint: ``.port`` (the bound port) and ``.stop()``."""

    def __init__(self, httpd: WSGIServer):
        self.name = "metrics-http"
        self._httpd = httpd
        self.port: int = httpd.server_address[1]
        self.url_host_port = ""  # host:port as a URL shows it (set by bind_wsgi)
        self._stopped = False
        self._loop = ServeLoop(httpd)
        self._thread = threading.Thread(target=self._loop.serve, name=self.name, daemon=True)

    def start(self) -> None:
        """Serve on the socket ``Metrics.bind`` bound (once; later calls do nothing)."""
        if not self._thread.is_alive() and not self._stopped:
            self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the listening socket (the port is free on return)."""
        if self._stopped:
            return
        self._stopped = True
        if self._thread.is_alive():
            self._loop.stop()
            self._thread.join()  # the loop ends at once: no request is mid-accept on close
        else:
            self._loop.close()
        self._httpd.server_close()

    def join(self, timeout_seconds: float) -> bool:
        if self._thread.is_alive():
            self._thread.join(max(timeout_seconds, 0.0))
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` (as nodemgr.config.loading validates it) -> (host, port)."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isascii() or not port.isdigit() or int(port) > 65535:
        raise BindError(f"metrics address must be host:port or [v6]:port (got {address!r})")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _why(e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return (
            "the port is in use (another gpushare-node or exporter?); set metrics.address "
            "to a free host:port, or metrics.enabled: false"
        )
    if e.errno == errno.EADDRNOTAVAIL:
        return "no interface of this node has that address; set metrics.address"
    if e.errno == errno.EACCES:
        return "permission denied (a port below 1024 needs CAP_NET_BIND_SERVICE)"
    return f"{e.strerror or e}; set metrics.address"


class ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    # A slow scraper must not hold up the next one, nor our shutdown.
    daemon_threads = True

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the bound host with socket.getfqdn,
        # which can wait seconds on DNS (0.0.0.0 becomes a lookup of our own
        # hostname); nothing here needs the name.
        socketserver.TCPServer.server_bind(self)
        # A TCP server's address is a (host, port[, flowinfo, scope_id]) tuple.
        self.server_name, self.server_port = cast("tuple[str, int]", self.server_address[:2])
        self.setup_environ()


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        # wsgiref writes every request to stderr; a scrape every 15 s is not news.
        pass
