"""nodemgr.extender.listener: every peer has a budget, and the real client always gets in.

A listener in this process with a small budget (so the tests run in seconds) and a
handler that answers with what it got. Pins, each while a real client's request is
answered: silent connections that never finish a TLS handshake (the oldest dropped for
a new one, so a flood cannot keep a handshake out, and each cut at its deadline);
headers sent a byte at a time (cut at the header deadline); a body sent slowly (cut at
the body deadline); authenticated idle connections over the cap (the longest idle
closed for the new one); a Content-Length over the cap (413 before a byte of the body
is read), chunked bodies (501), a head over its size (431), a second large body while
one is in flight (503), broken request lines and headers (400); pipelined requests
answered in order; ``stop`` closing every connection at once.
"""

from __future__ import annotations

import socket
import ssl
import time

import pytest

from nodemgr.extender.listener import (
    Budget,
    Listener,
    RequestError,
    Response,
    Serving,
    Stats,
    parse_head,
)
from nodemgr.extender.tls import ServerTls, TlsFiles
from standins.extender_tls import TlsMaterial, https_request

SMALL = Budget(
    max_connections=4,
    max_pending=8,
    handshake_seconds=1.0,
    idle_seconds=30.0,
    header_seconds=1.0,
    body_seconds=1.0,
    write_seconds=1.0,
    max_header_bytes=1024,
    max_body_bytes=3 * 1024 * 1024,
    workers=2,
)


def echo(request):
    return Response(200, "text/plain", b"%s %s %d" % (
        request.method.encode(), request.target.encode(), len(request.body)))  # fmt: skip


class Running:
    def __init__(self, tls=True, budget=SMALL, handler=echo):
        self.material = TlsMaterial() if tls else None
        server_tls = ServerTls(TlsFiles.in_directory(self.material.dir)) if tls else None
        self.stats = Stats()
        self.listener = Listener("test", ("127.0.0.1", 0), handler, budget, server_tls, self.stats)
        self.serving = Serving([self.listener])
        self.serving.start()
        self.port = self.listener.address[1]
        if tls:
            self.client = self.material.client(f"https://127.0.0.1:{self.port}/")

    def get(self, path="/ok"):
        return https_request(self.client, "GET", path, timeout=10)

    def counts(self):
        return self.serving.call(lambda: dict(self.stats.counts))

    def connected(self):
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        return self.client.context.wrap_socket(raw, server_hostname=self.client.server_name)

    def raw(self):
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def stop(self):
        self.serving.stop()


@pytest.fixture
def running():
    r = Running()
    yield r
    r.stop()


def closed_within(sock, seconds):
    """Whether the peer closed ``sock`` within ``seconds`` (reading what it sends)."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not sock.recv(4096):
                return True
    except (ConnectionError, ssl.SSLError):
        return True
    except TimeoutError:
        return False
    return False


def test_silent_connections_never_keep_a_handshake_out(running):
    """Twice the pending cap of connections that say nothing: the oldest are dropped for
    the newest, the client still gets its answer, and each silent one is cut by the
    handshake deadline."""
    silent = [running.raw() for _ in range(2 * SMALL.max_pending)]
    assert running.get() == (200, b"GET /ok 0")
    assert closed_within(silent[0], 5.0)  # evicted at once, long before its deadline
    assert closed_within(silent[-1], 5.0)  # the handshake deadline
    counts = running.counts()
    assert counts[("test", "handshake_evicted")] >= SMALL.max_pending
    assert counts[("test", "handshake_failed")] >= 1
    for sock in silent:
        sock.close()


def test_a_trickled_head_and_a_trickled_body_are_cut_at_their_deadlines(running):
    """An authenticated client sending its head a byte at a time, another its body: both cut
    (the deadline counts from the first byte, whatever the pace); the client meanwhile
    gets its answers."""
    slow_head = running.connected()
    slow_body = running.connected()
    slow_body.sendall(b"POST /x HTTP/1.1\r\nContent-Length: 100\r\n\r\nab")
    began = time.monotonic()
    cut = False
    for byte in b"GET /slow HTTP/1.1\r\nHost: x\r\n":
        try:
            slow_head.sendall(bytes([byte]))
        except (ConnectionError, ssl.SSLError):
            cut = True
            break
        assert running.get() == (200, b"GET /ok 0")
        time.sleep(0.1)
        if time.monotonic() - began > 5:
            break
    assert cut or closed_within(slow_head, 5.0)
    assert closed_within(slow_body, 5.0)
    counts = running.counts()
    assert counts[("test", "header_timeout")] == 1 and counts[("test", "body_timeout")] == 1


def test_over_the_cap_the_longest_idle_connection_makes_room(running):
    """More authenticated keep-alive connections than the cap: the idle one open longest
    is closed for the new one, and the new one is answered."""
    idle = [running.connected() for _ in range(SMALL.max_connections)]
    time.sleep(0.2)
    assert running.get() == (200, b"GET /ok 0")
    assert closed_within(idle[0], 2.0)
    assert running.counts()[("test", "evicted")] >= 1
    for sock in idle:
        sock.close()


def test_sizes_are_refused_before_they_are_read(running):
    """A Content-Length over the cap is answered 413 with no body sent; chunked 501; a head
    over its size 431; a second large body while one is in flight 503; bad lines 400."""

    def exchange(data, *, keep_sending=b""):
        sock = running.connected()
        sock.sendall(data)
        if keep_sending:
            sock.sendall(keep_sending)
        answer = sock.recv(4096)
        sock.close()
        return answer.split(b"\r\n", 1)[0]

    assert exchange(b"POST /x HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n") == (
        b"HTTP/1.1 413 Content Too Large"
    )
    assert exchange(b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n") == (
        b"HTTP/1.1 501 Not Implemented"
    )
    assert exchange(b"GET /x HTTP/1.1\r\nX: " + b"y" * 2000 + b"\r\n\r\n") == (
        b"HTTP/1.1 431 Request Header Fields Too Large"
    )
    assert exchange(b"GET /x HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n") == (
        b"HTTP/1.1 400 Bad Request"
    )
    assert exchange(b"GET\r\n\r\n") == b"HTTP/1.1 400 Bad Request"
    large = b"POST /x HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (2 * 1024 * 1024)
    first = running.connected()
    first.sendall(large + b"x")  # in flight: holds 2 MiB of the 3 MiB budget
    time.sleep(0.2)
    assert exchange(large) == b"HTTP/1.1 503 Service Unavailable"
    first.close()
    assert running.get() == (200, b"GET /ok 0")


def test_pipelined_requests_are_answered_in_order(running):
    sock = running.connected()
    sock.sendall(b"GET /a HTTP/1.1\r\n\r\nPOST /b HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc")
    data = b""
    while data.count(b"HTTP/1.1 200") < 2:
        data += sock.recv(4096)
    assert data.index(b"GET /a 0") < data.index(b"POST /b 3")
    sock.close()


def test_stop_closes_every_connection_at_once():
    r = Running()
    idle = r.connected()
    silent = r.raw()
    began = time.monotonic()
    r.stop()
    assert time.monotonic() - began < 2.0
    assert closed_within(idle, 2.0) and closed_within(silent, 2.0)


def test_the_plain_listener_answers_one_request_per_connection():
    budget = Budget(max_connections=2, keep_alive=False, max_body_bytes=0, workers=1)
    r = Running(tls=False, budget=budget)
    try:
        sock = r.raw()
        sock.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
        answer = b""
        while not answer.endswith(b"GET /healthz 0"):
            answer += sock.recv(4096)
        assert b"Connection: close" in answer
        assert closed_within(sock, 2.0)
    finally:
        r.stop()


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET / HTTP/1.1", None),
        (b"GET / HTTP/2.0", 505),
        (b"G ET / HTTP/1.1", 400),
        (b"GET / HTTP/1.1\r\nbad header", 400),
        (b"GET / HTTP/1.1\r\n folded: x", 400),
        (b"GET / HTTP/1.1\r\nContent-Length: -1", 400),
        (b"GET / HTTP/1.1\r\nContent-Length: \xd9\xa3", 400),
        (b"GET / HTTP/1.1\r\nContent-Length: 5", 413),
    ],
)
def test_parse_head(head, status):
    if status is None:
        assert parse_head(head, 4) == ("GET", "/", {}, 0, True)
        return
    with pytest.raises(RequestError) as refused:
        parse_head(head, 4)
    assert refused.value.status == status


def test_a_body_sent_with_the_end_of_the_handshake_is_read(running):
    """A client writes its request at once after its side of the handshake: what TLS hands
    over before the connection is admitted is kept, not taken for an overflow."""
    body = b"x" * (2 * 1024 * 1024)
    for _ in range(5):
        status, answer = https_request(running.client, "POST", "/big", body)
        assert (status, answer) == (200, b"POST /big %d" % len(body))
