"""The extender's HTTP/1.1 listeners, with a budget for every peer (asyncio, one thread).

kube-scheduler must always get in, while anyone who reaches the port (a NodePort from
every node, a hostNetwork pod on loopback) may open connections, send slowly, nothing
or a lot. So:

- one event loop thread holds every connection, TLS handshakes included (with the
  context of the moment, so a rotated certificate is used from the next connection);
  the verbs run in a few worker threads, one request of a connection at a time;
- every phase has a deadline (handshake, idle keep-alive, head, body, answer); a peer
  past one is cut, never waited on;
- bounded sizes: headers, the body (over ``max_body_bytes``: 413 unread; no chunked
  bodies), and large bodies in flight over all connections (the next one: 503);
- bounded counts: when ``max_connections`` is full, the connection idle or mid-headers
  longest is closed for the new one, which is refused only when all are busy; past
  ``max_pending`` handshakes the oldest is dropped, so silent connections cannot keep a
  real client's handshake out;
- ``stop`` closes everything at once.

Refusals and cuts are counted by listener and reason (``Stats``). The plain listener
(``tls=None``) is for kubelet's probes: GET only, no body, one request per connection.

What it must not do: run a handler on the loop thread, read a body it is
going to refuse, or keep a connection past its deadline.

Longer than 400 lines: one HTTP/1.1 server whose parts each read the others' state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from nodemgr.extender.tls import ServerTls

log = logging.getLogger("nodemgr.extender")

LARGE_BODY_BYTES = 1024 * 1024  # bodies above this share one budget of bytes in flight
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}
_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


@dataclass(frozen=True)
class Budget:
    max_connections: int = 64  # open at once (TLS: authenticated ones)
    max_pending: int = 256  # TLS handshakes in progress
    handshake_seconds: float = 5.0
    idle_seconds: float = 120.0  # for the next request (Go's client drops idle ones at 90 s)
    header_seconds: float = 10.0  # request line and headers, from their first byte
    body_seconds: float = 60.0  # the body, from the end of the headers
    write_seconds: float = 60.0  # the answer, to a peer that stopped reading
    max_header_bytes: int = 16 * 1024
    max_body_bytes: int = 0
    keep_alive: bool = True
    workers: int = 8


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    headers: Mapping[str, str]  # lowercased names
    body: bytes
    peer: str


@dataclass(frozen=True)
class Response:
    status: int
    content_type: str
    body: bytes


Handler = Callable[[Request], Response]


class Stats:
    """By listener and reason; the loop thread writes."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}

    def count(self, listener: str, reason: str) -> None:
        key = (listener, reason)
        self.counts[key] = self.counts.get(key, 0) + 1


class _Workers:
    """Daemon threads: a stuck one never holds up the exit."""

    def __init__(self, name: str, count: int):
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for i in range(count):
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the connection, which answers 500
                future.set_exception(e)


class RequestError(Exception):
    def __init__(self, status: int, message: str, reason: str):
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason


def parse_head(head: bytes, max_body_bytes: int) -> tuple[str, str, dict[str, str], int, bool]:
    """(method, target, headers, content length, keep alive); RequestError otherwise."""
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise RequestError(400, "the request head is not ASCII", "bad_request") from None
    line, *lines = text.split("\r\n")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[0] or not set(parts[0]) <= _TOKEN or not parts[1]:
        raise RequestError(400, "a bad request line", "bad_request")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise RequestError(505, f"{version[:16]!r} is not HTTP/1.1", "bad_request")
    headers: dict[str, str] = {}
    lengths = set()
    for header in lines:
        name, colon, value = header.partition(":")
        if not colon or not name or not set(name) <= _TOKEN:
            raise RequestError(400, "a bad header line", "bad_request")
        name, value = name.lower(), value.strip(" \t")
        if name == "content-length":
            lengths.add(value)
        headers[name] = value
    if "transfer-encoding" in headers:
        raise RequestError(501, "no Transfer-Encoding is accepted: send Content-Length", "chunked")
    length = 0
    if lengths:
        value = lengths.pop() if len(lengths) == 1 else ""
        if not value.isascii() or not value.isdigit() or len(value) > 15:
            raise RequestError(400, "a bad Content-Length", "bad_request")
        length = int(value)
    if length > max_body_bytes:
        raise RequestError(413, f"a body over {max_body_bytes} bytes", "too_large")
    connection = headers.get("connection", "").lower()
    keep = version == "HTTP/1.1" and "close" not in connection
    return method, target, headers, length, keep


class Listener:
    def __init__(
        self,
        name: str,
        address: tuple[str, int],
        handler: Handler,
        budget: Budget,
        tls: ServerTls | None = None,
        stats: Stats | None = None,
    ):
        self.name = name
        self.handler = handler
        self.budget = budget
        self.tls = tls
        self.stats = stats or Stats()
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.create_server(address, family=family, backlog=1024)
        self.workers = _Workers(f"{name}-worker", budget.workers)
        self.connections: OrderedDict[_Connection, None] = OrderedDict()
        self.pending: OrderedDict[asyncio.Transport, None] = OrderedDict()
        self.large_bytes_free = budget.max_body_bytes

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.socket.getsockname()[:2]
        return str(host), int(port)

    # --- the loop thread from here on ---------------------------------------------------

    def accepted(self, transport: asyncio.Transport) -> None:
        if self.tls is None:
            self._admit(_Connection(self), transport)
            return
        transport.pause_reading()  # nothing is read before the TLS handshake reads it
        while len(self.pending) >= self.budget.max_pending:
            oldest, _ = self.pending.popitem(last=False)
            oldest.abort()
            self.stats.count(self.name, "handshake_evicted")
        self.pending[transport] = None
        asyncio.get_running_loop().create_task(self._upgrade(transport))

    async def _upgrade(self, transport: asyncio.Transport) -> None:
        assert self.tls is not None
        connection = _Connection(self)
        try:
            secure = await asyncio.get_running_loop().start_tls(
                transport,
                connection,
                self.tls.context(),
                server_side=True,
                ssl_handshake_timeout=self.budget.handshake_seconds,
            )
        except (TimeoutError, OSError) as e:  # SSLError and resets are OSErrors
            self.pending.pop(transport, None)
            transport.abort()
            self.stats.count(self.name, "handshake_failed")
            log.debug("%s: TLS handshake with %s failed: %s", self.name, _peer(transport), e)
            return
        self.pending.pop(transport, None)
        if secure is None or connection.lost:  # gone as the handshake ended, or too much
            if secure is not None:
                secure.abort()
            return
        why = self.tls.accepts(secure.get_extra_info("peercert"))
        if why:
            secure.abort()
            self.stats.count(self.name, "not_authorized")
            log.info("%s: refused %s: %s", self.name, _peer(transport), why)
            return
        self._admit(connection, secure)

    def _admit(self, connection: _Connection, transport: asyncio.Transport) -> None:
        if len(self.connections) >= self.budget.max_connections:
            waiting = next((c for c in self.connections if c.state in ("idle", "head")), None)
            if waiting is None:
                transport.abort()
                self.stats.count(self.name, "over_capacity")
                return
            waiting.cut("evicted")
        transport.set_protocol(connection)
        connection.connection_made(transport)

    def close_all(self) -> None:
        for transport in list(self.pending):
            transport.abort()
        self.pending.clear()
        for connection in list(self.connections):
            connection.cut("stopped")


def _peer(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"


class _Accepting(asyncio.Protocol):
    def __init__(self, listener: Listener):
        self._listener = listener

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._listener.accepted(cast(asyncio.Transport, transport))


class _Connection(asyncio.Protocol):
    def __init__(self, listener: Listener):
        self.listener = listener
        self.budget = listener.budget
        self.transport: asyncio.Transport | None = None
        self.state = "idle"  # idle, head, body, busy, closing
        self.buffer = bytearray()
        self.peer = "?"
        self._timer: asyncio.TimerHandle | None = None
        self._head: tuple[str, str, dict[str, str], int, bool] | None = None
        self._reserved = 0
        self.lost = False

    # --- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.peer = _peer(transport)
        self.listener.connections[self] = None
        self._arm(self.budget.idle_seconds, "idle_timeout")
        if self.buffer:  # came with the end of the TLS handshake, before we were told
            self.state = "head"
            self._arm(self.budget.header_seconds, "header_timeout")
            self._advance()

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            # TLS hands over what came with the end of the handshake before we are told:
            # kept for connection_made, within what one request may hold.
            self.buffer += data
            if len(self.buffer) > self.budget.max_header_bytes + self.budget.max_body_bytes:
                self.lost = True  # closed when the handshake's end is handled
            return
        if self.state in ("busy", "closing"):
            self.buffer += data  # pipelined: read when this request is answered
            if len(self.buffer) > self.budget.max_header_bytes:
                self.cut("too_large")
            return
        if self.state == "idle":
            self.state = "head"
            self._arm(self.budget.header_seconds, "header_timeout")
        self.buffer += data
        self._advance()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._disarm()
        self._release()
        self.state = "closing"
        self.listener.connections.pop(self, None)
        self.transport = None

    # --- the request ------------------------------------------------------------------------

    def _advance(self) -> None:
        if self.state == "head":
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0 or end > self.budget.max_header_bytes:
                if end > self.budget.max_header_bytes or (
                    end < 0 and len(self.buffer) > self.budget.max_header_bytes
                ):
                    self._refuse(431, "the request head is too large", "too_large")
                return
            head = bytes(self.buffer[:end])
            del self.buffer[: end + 4]
            try:
                self._head = parse_head(head, self.budget.max_body_bytes)
            except RequestError as e:
                self._refuse(e.status, e.message, e.reason)
                return
            length = self._head[3]
            if length > LARGE_BODY_BYTES:
                if self.listener.large_bytes_free < length:
                    self._refuse(503, "busy with another large request", "busy")
                    return
                self.listener.large_bytes_free -= length
                self._reserved = length
            self.state = "body"
            self._arm(self.budget.body_seconds, "body_timeout")
            if length and self._head[2].get("expect", "").lower() == "100-continue":
                self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self.state == "body" and self._head is not None:
            length = self._head[3]
            if len(self.buffer) < length:
                return
            body = bytes(self.buffer[:length])
            del self.buffer[:length]
            self._dispatch(body)

    def _dispatch(self, body: bytes) -> None:
        assert self._head is not None
        assert self.transport is not None
        method, target, headers, _, keep = self._head
        self.state = "busy"
        self._disarm()
        self.transport.pause_reading()
        request = Request(method, target, headers, body, self.peer)
        future = self.listener.workers.submit(self.listener.handler, request)
        asyncio.wrap_future(future).add_done_callback(
            lambda done: self._answered(done, keep and self.budget.keep_alive)
        )

    def _answered(self, done: asyncio.Future[Any], keep: bool) -> None:
        self._release()
        if self.transport is None:
            return  # closed meanwhile (stop, or the peer went away)
        if done.cancelled() or done.exception() is not None:
            error = None if done.cancelled() else done.exception()
            log.error("%s: the handler failed", self.listener.name, exc_info=error)
            response = Response(500, "text/plain", b"internal error\n")
        else:
            response = done.result()
        self._respond(response, keep)
        if not keep:
            return
        self.state, self._head = "idle", None
        self._arm(self.budget.idle_seconds, "idle_timeout")
        self.transport.resume_reading()
        if self.buffer:
            self.state = "head"
            self._arm(self.budget.header_seconds, "header_timeout")
            self._advance()

    def _refuse(self, status: int, message: str, reason: str) -> None:
        self.listener.stats.count(self.listener.name, reason)
        self._respond(Response(status, "text/plain", (message + "\n").encode()), keep=False)

    def _respond(self, response: Response, keep: bool) -> None:
        lines = [
            f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'Unknown')}",
            f"Content-Type: {response.content_type}",
            f"Content-Length: {len(response.body)}",
            "Server: gpushare-scheduler",
        ]
        if not keep:
            lines.append("Connection: close")
        self._write(("\r\n".join(lines) + "\r\n\r\n").encode() + response.body)
        if not keep and self.transport is not None:
            self.state = "closing"
            self.transport.close()  # after the answer is written; the write deadline holds
            self._arm(self.budget.write_seconds, "write_timeout")

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def pause_writing(self) -> None:  # the peer stopped reading: it has write_seconds
        self._arm(self.budget.write_seconds, "write_timeout")

    def resume_writing(self) -> None:
        if self.state == "busy":
            self._disarm()

    # --- deadlines and budgets ----------------------------------------------------------

    def _arm(self, seconds: float, reason: str) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(seconds, self.cut, reason)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _release(self) -> None:
        self.listener.large_bytes_free += self._reserved
        self._reserved = 0

    def cut(self, reason: str) -> None:
        if self.transport is None:
            return
        if reason != "idle_timeout" or self.state != "idle":
            self.listener.stats.count(self.listener.name, reason)
        if reason not in ("stopped", "idle_timeout"):
            log.debug("%s: closed %s (%s)", self.listener.name, self.peer, reason)
        transport = self.transport
        self.connection_lost(None)
        transport.abort()


@dataclass
class Serving:
    listeners: list[Listener] = field(default_factory=list)
    loop: asyncio.AbstractEventLoop | None = None
    thread: threading.Thread | None = None
    _servers: list[asyncio.AbstractServer] = field(default_factory=list)

    def start(self) -> None:
        ready = threading.Event()
        self.loop = asyncio.new_event_loop()

        async def serve() -> None:
            for listener in self.listeners:
                server = await asyncio.get_running_loop().create_server(
                    lambda listener=listener: _Accepting(listener),  # type: ignore[misc]
                    sock=listener.socket,
                )
                self._servers.append(server)
            ready.set()

        def run() -> None:
            assert self.loop is not None
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(serve())
            self.loop.run_forever()
            self.loop.close()

        self.thread = threading.Thread(target=run, name="http", daemon=True)
        self.thread.start()
        ready.wait(10)

    def call(self, fn: Callable[[], Any]) -> Any:
        assert self.loop is not None
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as e:
                done.set_exception(e)

        self.loop.call_soon_threadsafe(run)
        return done.result(5)

    def stop(self, timeout: float = 2.0) -> None:
        loop, thread = self.loop, self.thread
        if loop is None or thread is None or not thread.is_alive():
            return

        def shut() -> None:
            for server in self._servers:
                server.close()
            for listener in self.listeners:
                listener.close_all()
            # The sockets close in the callbacks the aborts scheduled (TLS: two layers
            # deep): those run before the loop ends.
            loop.call_later(0.05, loop.stop)

        loop.call_soon_threadsafe(shut)
        thread.join(timeout)
