"""The metrics endpoint's HTTP server: bound to one address, served by one thread.

wsgiref with a thread per request (a slow scraper holds up nobody), no DNS lookup at
bind, no request log. What it must not do: know what the metrics are
(``nodemgr.status.metrics`` hands it a WSGI app).

Every local user and hostNetwork pod reaches the port, so it has a budget
(:mod:`nodemgr.common.connbudget`): the request head must arrive whole within
``HEAD_SECONDS`` and be at most ``MAX_HEAD_BYTES`` (431 when larger), a body is never
read, and each connection is cut ``DEADLINE_SECONDS`` after it was accepted.
"""

from __future__ import annotations

import errno
import io
import socket
import socketserver
import threading
import time
from typing import Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import WSGIApplication

from nodemgr.common.connbudget import (
    MALFORMED,
    SLOW,
    TOO_LARGE,
    BudgetedServer,
    ConnectionBudget,
    ListenerStats,
)
from nodemgr.common.serveloop import ServeLoop
from nodemgr.errors import BindError

# docs/operations.md, Metrics. Prometheus scrapes every 15 s or so, one connection at a time.
MAX_CONNECTIONS = 16
HEAD_SECONDS = 2.0  # in all, not per read
MAX_HEAD_BYTES = 8 * 1024
DEADLINE_SECONDS = 10.0  # accepted to closed, the answer to a slow reader included
# A burst of scrapers waits in the kernel's accept queue, not in us.
LISTEN_BACKLOG = 64
_TOO_LARGE_ANSWER = (
    b"HTTP/1.0 431 Request Header Fields Too Large\r\nContent-Type: text/plain\r\n"
    b"Connection: close\r\n\r\nrequest head over %d bytes\n" % MAX_HEAD_BYTES
)


def bind_wsgi(address: str, app: WSGIApplication) -> MetricsServer:
    """Bound to ``host:port`` (``[v6]:port``; port 0 = any free port); BindError saying
    which address and why."""
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
        httpd = cast("ThreadingServer", make_server(host, port, app, server_class, QuietHandler))
    except OSError as e:
        raise BindError(f"cannot serve metrics on {address}: {_why(e)}") from e
    httpd.budget = ConnectionBudget("metrics-http", MAX_CONNECTIONS, DEADLINE_SECONDS)
    server = MetricsServer(httpd)
    server.url_host_port = join_host_port(host, server.port)
    return server


class MetricsServer:
    def __init__(self, httpd: ThreadingServer):
        self.name = "metrics-http"
        self._httpd = httpd
        self.port: int = httpd.server_address[1]
        self.url_host_port = ""  # as a URL shows it
        self._stopped = False
        self._loop = ServeLoop(httpd)
        self._thread = threading.Thread(target=self._loop.serve, name=self.name, daemon=True)

    def start(self) -> None:
        """Once; later calls do nothing."""
        if not self._thread.is_alive() and not self._stopped:
            self._httpd.budget.start()
            self._thread.start()

    @property
    def budget(self) -> ConnectionBudget:
        return self._httpd.budget

    def stats(self) -> ListenerStats:
        return self._httpd.budget.stats()

    def stop(self) -> None:
        """The port is free on return."""
        if self._stopped:
            return
        self._stopped = True
        if self._thread.is_alive():
            self._loop.stop()
            self._thread.join()  # the loop ends at once: no request is mid-accept on close
        else:
            self._loop.close()
        self._httpd.budget.stop()
        self._httpd.server_close()

    def join(self, timeout_seconds: float) -> bool:
        if self._thread.is_alive():
            self._thread.join(max(timeout_seconds, 0.0))
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped


def split_host_port(address: str) -> tuple[str, int]:
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


class ThreadingServer(BudgetedServer, socketserver.ThreadingMixIn, WSGIServer):
    # A slow scraper must not hold up the next one, nor our shutdown.
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn, which can wait seconds on DNS;
        # nothing here needs the name.
        socketserver.TCPServer.server_bind(self)
        # A TCP server's address is a (host, port[, flowinfo, scope_id]) tuple.
        self.server_name, self.server_port = cast("tuple[str, int]", self.server_address[:2])
        self.setup_environ()


class QuietHandler(WSGIRequestHandler):
    """wsgiref's handler, given a request head read within its budget."""

    server: ThreadingServer
    timeout = DEADLINE_SECONDS  # each send of the answer (the deadline bounds them all)

    def handle(self) -> None:
        head = self._read_head()
        if head is None:
            return
        self.rfile = io.BytesIO(head)  # wsgiref parses what was read; a body is never read
        self.connection.settimeout(self.timeout)
        super().handle()

    def _read_head(self) -> bytes | None:
        """None when the connection is to be closed (counted; 431 if too large)."""
        budget, sock = self.server.budget, self.connection
        deadline = time.monotonic() + HEAD_SECONDS
        data = b""
        while True:
            end = _head_end(data)
            if end is not None:
                return data[:end]
            if len(data) > MAX_HEAD_BYTES:
                budget.refuse(TOO_LARGE)
                self._answer_at_once(_TOO_LARGE_ANSWER)
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                budget.refuse(SLOW)
                return None
            sock.settimeout(left)
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                budget.refuse(SLOW)
                return None
            except OSError:
                return None  # reset by the client, or cut at the deadline (counted there)
            if not chunk:
                if data and not budget.was_cut(sock):
                    budget.refuse(MALFORMED)  # closed halfway through a request head
                return None
            data += chunk

    def _answer_at_once(self, answer: bytes) -> None:
        try:
            self.connection.settimeout(1.0)
            self.connection.sendall(answer)
        except OSError:
            pass  # the client does not read: it is closed anyway

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # BaseHTTPRequestHandler answers 400, 414 and 505 to what is not HTTP/1.x.
        if code < 500 or code == 505:
            self.server.budget.refuse(MALFORMED)
        super().send_error(code, message, explain)

    def log_message(self, format: str, *args: Any) -> None:
        # wsgiref writes every request to stderr; a scrape every 15 s is not news.
        pass


def _head_end(data: bytes) -> int | None:
    for blank in (b"\r\n\r\n", b"\n\n"):
        at = data.find(blank)
        if at >= 0:
            return at + len(blank)
    return None
