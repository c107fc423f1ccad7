"""Pins the budget of nodemgr.status.http, the metrics endpoint's server (the port every
local user reaches): at most MAX_CONNECTIONS served at once, the rest closed at once,
unread, and served again once they end; a request head that does not arrive whole within
HEAD_SECONDS is cut however it trickles; one over MAX_HEAD_BYTES is answered 431 and
closed; a request that is not HTTP is answered 400; a body is never read; each is counted
by reason in the listener's stats; a scrape still answers after all of them; and the
deadline costs nothing while no connection is open."""

import socket
import time
import urllib.request

import pytest

from nodemgr.status import http
from nodemgr.status.metrics import Metrics
from standins.threadstats import wakeups_while_idle


def document():
    return {
        "node": "node-a",
        "daemon": None,
        "gpus": [],
        "allocations": [],
        "enforcement": None,
    }


@pytest.fixture
def server():
    server = Metrics(document).serve("127.0.0.1:0")
    yield server
    server.stop()


def scrape(server) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
        return r.read().decode()


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def answer_of(sock: socket.socket, seconds: float = 5.0) -> bytes:
    """Everything the server sends until it closes (b"" when it closed without a word)."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def wait_for(predicate, seconds: float = 5.0):
    deadline = time.monotonic() + seconds
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    return value


def test_connections_over_the_cap_are_closed_at_once_and_served_again_after(server):
    """MAX_CONNECTIONS idle connections are held; the next ones are closed at once, unread,
    and counted; once the held ones end, a scrape is served."""
    held = [connect(server) for _ in range(http.MAX_CONNECTIONS)]
    wait_for(lambda: server.stats()["connections"] == http.MAX_CONNECTIONS)
    extra = [connect(server) for _ in range(20)]
    started = time.monotonic()
    assert [answer_of(sock) for sock in extra] == [b""] * 20
    assert time.monotonic() - started < 2.0
    assert server.stats()["refused"]["cap"] == 20
    for sock in held + extra:
        sock.close()
    wait_for(lambda: server.stats()["connections"] == 0)
    assert "gpushare_scrape_errors" in scrape(server)


def test_a_trickled_request_head_is_cut_at_the_head_deadline(server):
    """A client sending its request a byte every 0.2 s is closed HEAD_SECONDS after it
    connected, not served (the per-read timeout never fires: each byte comes in time)."""
    sock = connect(server)
    request = b"GET /metrics HTTP/1.1\r\nHost: node-a\r\nX-Slow: " + b"a" * 100
    started = time.monotonic()
    sock.setblocking(False)
    closed_after = None
    for byte in request:
        try:
            sock.send(bytes([byte]))
            if sock.recv(1) == b"":
                closed_after = time.monotonic() - started
                break
        except BlockingIOError:
            pass
        except OSError:
            closed_after = time.monotonic() - started
            break
        time.sleep(0.2)
    sock.close()
    assert closed_after is not None, "the trickle was never cut"
    assert http.HEAD_SECONDS - 0.1 <= closed_after < http.HEAD_SECONDS + 1.0, closed_after
    assert server.stats()["refused"]["slow"] == 1


def test_a_request_head_over_its_limit_is_answered_431_unread(server):
    """64 MiB of header bytes: the server reads MAX_HEAD_BYTES or so, answers 431 and
    closes; the client cannot push the rest into it."""
    sock = connect(server)
    sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Big: ")
    sent = 0
    try:
        chunk = b"a" * 65536
        while sent < 64 * 1024 * 1024:
            sent += sock.send(chunk)
    except OSError:
        pass  # closed under it
    answer = answer_of(sock)
    sock.close()
    assert sent < 16 * 1024 * 1024, sent  # the kernel's buffers, not the server's memory
    assert answer.startswith(b"HTTP/1.0 431 "), answer[:80]
    assert server.stats()["refused"]["too_large"] == 1
    assert "gpushare_scrape_errors" in scrape(server)


def test_bytes_that_are_not_http_are_answered_400(server):
    sock = connect(server)
    sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\xff" * 200 + b"\r\n\r\n")
    answer = answer_of(sock)
    sock.close()
    assert b"400" in answer, answer[:200]
    assert server.stats()["refused"]["malformed"] == 1


def test_a_body_is_never_read(server):
    """A scrape announcing a 1 GiB body is answered at once; the body is not waited for."""
    sock = connect(server)
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: a\r\nContent-Length: 1073741824\r\n\r\n")
    started = time.monotonic()
    answer = answer_of(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.0 200 "), answer[:80]
    assert time.monotonic() - started < 2.0


def test_a_held_connection_is_cut_at_its_deadline(server):
    """A connection still open at its deadline is cut, whatever its handler is doing (here
    a deadline shorter than the head's read time), and counted once, as cut."""
    server.budget.deadline_seconds = 0.5
    sock = connect(server)
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: a")  # never finished: the read waits
    started = time.monotonic()
    assert answer_of(sock, 5.0) == b""
    assert time.monotonic() - started < http.HEAD_SECONDS
    sock.close()
    wait_for(lambda: server.stats()["connections"] == 0)
    refused = server.stats()["refused"]
    assert (refused["deadline"], refused["slow"], refused["malformed"]) == (1, 0, 0)


def test_the_deadline_thread_sleeps_while_no_connection_is_open(server):
    """Between scrapes nothing wakes the deadline thread (no timer while idle)."""
    scrape(server)
    wait_for(lambda: server.stats()["connections"] == 0)
    assert wakeups_while_idle(server.budget._thread) == 0
