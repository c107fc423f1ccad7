"""Pins the hook socket protocol (hooks/protocol.py): one JSON object and a newline each
way; a message round-trips through encode/read_message also when it arrives in pieces;
oversized, non-JSON, non-object and empty messages are refused with ProtocolError; an
answer without ``allowed``/``message`` is refused by ``call``."""

import json
import os
import socket
import tempfile
import threading
import time

import pytest

from hooks import protocol
from hooks.protocol import ProtocolError

REQUEST = {
    "stage": protocol.CREATE,
    "container_id": "c1",
    "pid": 1234,
    "env": {"NVIDIA_VISIBLE_DEVICES": "GPU-a", "GPUSHARE_ALLOCATION_ID": "ga-1"},
    "identity": {"namespace": "ml", "pod": "train-0", "container": "main"},
    "cgroup": "0::/kubepods/pod1/c1\n",
}


def test_encode_is_one_compact_line():
    """An encoded message is compact JSON ending in exactly one newline, none inside."""
    data = protocol.encode(REQUEST)
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert b", " not in data and b": " not in data
    assert json.loads(data) == REQUEST


def test_decode_round_trips():
    """decode(encode(m)) is m."""
    assert protocol.decode(protocol.encode(REQUEST)) == REQUEST


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"not json\n", "not JSON"),
        (b"\xff\xfe\n", "not JSON"),
        (b"[1, 2]\n", "not a JSON object"),
        (b'"text"\n', "not a JSON object"),
    ],
)
def test_garbage_is_refused(data, fragment):
    """Bytes that are not one JSON object raise ProtocolError saying why."""
    with pytest.raises(ProtocolError, match=fragment):
        protocol.decode(data)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b'{"stage": "poststop", "stage": "createRuntime"}\n', "the key 'stage' appears twice"),
        (b'{"spec": {"mounts": [{"a": 1, "a": 2}]}}\n', "the key 'a' appears twice"),
        (b'{"a": 1} {"a": 2}\n', "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ],
)
def test_what_go_and_python_read_differently_or_not_at_all_is_refused(data, fragment):
    """A key twice in one object (Go's encoding/json merges or overwrites where Python keeps
    the last), data after the message and nesting past the interpreter's recursion limit
    raise ProtocolError naming the problem, never another exception."""
    with pytest.raises(ProtocolError, match=fragment):
        protocol.decode(data, max_bytes=len(data))


def test_decode_refuses_oversized():
    """A message over the limit is refused before it is parsed."""
    data = protocol.encode({"x": "a" * 100})
    with pytest.raises(ProtocolError, match="over 50 bytes"):
        protocol.decode(data, max_bytes=50)


def pair():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    return a, b


def test_read_message_joins_pieces_up_to_the_newline():
    """A message written in several pieces is read whole, up to its newline."""
    a, b = pair()
    with a, b:
        data = protocol.encode(REQUEST)

        def send():
            for i in range(0, len(data), 7):
                b.sendall(data[i : i + 7])

        thread = threading.Thread(target=send)
        thread.start()
        assert protocol.read_message(a) == REQUEST
        thread.join()


def test_read_message_without_newline_reads_to_eof():
    """A peer that closes after the JSON without a newline still delivers its message."""
    a, b = pair()
    with a:
        b.sendall(b'{"stage": "poststop", "container_id": "c1"}')
        b.close()
        assert protocol.read_message(a) == {"stage": "poststop", "container_id": "c1"}


def test_read_message_refuses_an_endless_stream():
    """A peer that keeps writing without a newline is cut off past the limit."""
    a, b = pair()
    with a, b:
        b.sendall(b"x" * 5000)
        with pytest.raises(ProtocolError, match="over 1024 bytes"):
            protocol.read_message(a, max_bytes=1024)


def test_read_message_refuses_a_closed_connection():
    """A connection closed before any byte is a ProtocolError, not an empty message."""
    a, b = pair()
    with a:
        b.close()
        with pytest.raises(ProtocolError, match="closed before a message"):
            protocol.read_message(a)


@pytest.fixture
def serve():
    """A one-shot unix server answering each connection with ``answer_bytes``."""
    directory = tempfile.mkdtemp(dir="/tmp", prefix="gs-proto-")
    path = os.path.join(directory, "hook.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    received = []

    def start(answer_bytes: bytes):
        def run():
            conn, _ = server.accept()
            with conn:
                conn.settimeout(5)
                received.append(protocol.read_message(conn))
                conn.sendall(answer_bytes)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    yield path, start, received
    server.close()
    os.unlink(path)
    os.rmdir(directory)


def test_call_sends_the_request_and_returns_the_answer(serve):
    """``call`` writes one request and returns the daemon's answer."""
    path, start, received = serve
    thread = start(protocol.encode({"allowed": False, "message": "refused: no allocation"}))
    answer = protocol.call(path, REQUEST, timeout_seconds=5)
    thread.join(5)
    assert answer == {"allowed": False, "message": "refused: no allocation"}
    assert received == [REQUEST]


@pytest.mark.parametrize(
    "answer", [{"allowed": "yes", "message": "m"}, {"allowed": True}, {"message": "m"}]
)
def test_call_refuses_an_answer_without_allowed_and_message(serve, answer):
    """An answer lacking a boolean ``allowed`` or a string ``message`` is a ProtocolError."""
    path, start, _ = serve
    thread = start(protocol.encode(answer))
    with pytest.raises(ProtocolError, match="without allowed/message"):
        protocol.call(path, REQUEST, timeout_seconds=5)
    thread.join(5)


def test_call_without_a_daemon_raises_oserror(tmp_path):
    """No socket: OSError (the hook turns it into its own refusal or pass)."""
    with pytest.raises(FileNotFoundError):
        protocol.call(str(tmp_path / "none.sock"), REQUEST, timeout_seconds=1)


def test_call_timeout_is_a_total_deadline():
    """A daemon that trickles its answer a byte every 0.2 s (each recv returns in time):
    ``call`` gives up at its total timeout, not at the end of the trickle."""
    answer = protocol.encode({"allowed": True, "message": "x" * 40})
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    directory = tempfile.mkdtemp(dir="/tmp", prefix="gs-proto-")
    slow_path = os.path.join(directory, "slow.sock")
    listener.bind(slow_path)
    listener.listen(1)
    stop = threading.Event()

    def trickle():
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(5)
            protocol.read_message(conn)
            for byte in answer:
                if stop.wait(0.2):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        with pytest.raises((OSError, ProtocolError)):
            protocol.call(slow_path, REQUEST, timeout_seconds=1.0)
        assert time.monotonic() - started < 1.5
    finally:
        stop.set()
        thread.join(5)
        listener.close()
        os.unlink(slow_path)
        os.rmdir(directory)


def test_call_tries_again_when_the_daemon_closes_at_once():
    """A daemon at its connection cap closes new connections unread: ``call`` connects
    again (within its timeout) and gets the answer once a place is free."""
    directory = tempfile.mkdtemp(dir="/tmp", prefix="gs-proto-")
    path = os.path.join(directory, "hook.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    seen = []

    def serve_third():
        for i in range(3):
            conn, _ = listener.accept()
            with conn:
                seen.append(i)
                if i < 2:
                    continue  # over the cap: closed at once, nothing read
                conn.settimeout(5)
                protocol.read_message(conn)
                conn.sendall(protocol.encode({"allowed": True, "message": "ok"}))

    thread = threading.Thread(target=serve_third, daemon=True)
    thread.start()
    try:
        answer = protocol.call(path, REQUEST, timeout_seconds=2.0)
        assert answer == {"allowed": True, "message": "ok"}
        assert seen == [0, 1, 2]
    finally:
        thread.join(5)
        listener.close()
        os.unlink(path)
        os.rmdir(directory)
