"""Pins nodemgr.common.unixserver.UnixServer: the socket file is 0600 (root only) whatever
the process umask; a stale file left by a killed daemon is replaced; a missing directory
is made; each connection reaches ``handle``; ``stop`` removes the file and is safe twice;
``alive``/``join`` follow the lifecycle; and the process umask is never touched (another
thread creating files while a server starts gets the modes it expects). Each connection has
a total deadline (a client trickling bytes is cut at it, whatever the handler's per-call
timeouts); connections over the cap are closed at once, counted, and logged once per burst."""

import os
import shutil
import socket
import stat
import tempfile
import threading
import time

import pytest

from nodemgr.common.unixserver import SOCKET_MODE, UnixServer
from standins.threadstats import wakeups_while_idle


def umask_now() -> int:
    """The process umask, read without changing it (Linux: /proc/self/status)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    pytest.skip("this kernel does not show Umask in /proc/self/status")


def echo(sock: socket.socket) -> None:
    sock.settimeout(5)
    data = sock.recv(1024)
    sock.sendall(b"echo:" + data)


def ask(path: str, data: bytes = b"hi") -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        sock.sendall(data)
        return sock.recv(1024)


@pytest.fixture
def socket_dir():
    # Unix socket paths must stay under 108 bytes; pytest's tmp_path may not.
    directory = tempfile.mkdtemp(dir="/tmp", prefix="gs-unix-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def make_server(socket_dir):
    made = []

    def make(path=None, handle=echo, **limits):
        server = UnixServer(
            path or os.path.join(socket_dir, "s.sock"), handle, "test-server", **limits
        )
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()


def test_serves_each_connection_through_handle(make_server):
    """A client's request reaches ``handle`` and its answer comes back."""
    server = make_server()
    server.start()
    assert ask(server.socket_path, b"one") == b"echo:one"
    assert ask(server.socket_path, b"two") == b"echo:two"


def test_socket_is_root_only_even_with_a_permissive_umask(make_server):
    """The socket file is a socket of mode 0600, also when the umask would leave it 0777."""
    server = make_server()
    old = os.umask(0)
    try:
        server.start()
    finally:
        os.umask(old)
    mode = os.stat(server.socket_path).st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == SOCKET_MODE == 0o600


def test_an_idle_server_never_wakes_up(make_server):
    """Between connections the serving thread sleeps in select with no timeout (the old
    0.1 s poll woke the hook and status servers 10 times a second each)."""
    server = make_server()
    server.start()
    assert ask(server.socket_path) == b"echo:hi"
    assert wakeups_while_idle(server._thread) == 0


def test_a_stale_file_is_replaced(make_server, socket_dir):
    """A socket file left by a killed daemon (nobody listening) does not stop a start."""
    path = os.path.join(socket_dir, "s.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays; connecting to it is refused
    with pytest.raises(ConnectionRefusedError):
        ask(path)
    server = make_server(path)
    server.start()
    assert ask(path) == b"echo:hi"


def test_a_missing_directory_is_made(make_server, socket_dir):
    """The run directory may not exist yet at boot: start makes it."""
    path = os.path.join(socket_dir, "run", "gpushare", "s.sock")
    server = make_server(path)
    server.start()
    assert ask(path) == b"echo:hi"


def test_stop_removes_the_socket_and_is_safe_twice(make_server):
    """After stop the file is gone and nobody is served; a second stop does nothing."""
    server = make_server()
    server.start()
    server.stop()
    assert not os.path.exists(server.socket_path)
    with pytest.raises(FileNotFoundError):
        ask(server.socket_path)
    server.stop()


def test_alive_and_join_follow_the_lifecycle(make_server):
    """alive: only between start and stop; stop asks, join waits: True once it ended."""
    server = make_server()
    assert not server.alive
    server.start()
    assert server.alive
    assert server.join(0.0) is False  # still serving
    server.stop()
    assert not server.alive
    assert server.join(5.0) is True
    assert server.join(0.0) is True


def test_a_handler_error_closes_only_that_connection(make_server):
    """An exception in ``handle`` ends that connection; the server keeps serving."""
    calls = []

    def handle(sock):
        calls.append(1)
        if len(calls) == 1:
            sock.recv(1024)
            raise RuntimeError("bug in the handler")
        echo(sock)

    server = make_server(handle=handle)
    server.start()
    assert ask(server.socket_path) == b""  # closed without an answer
    assert ask(server.socket_path) == b"echo:hi"
    assert server.alive


def test_start_never_changes_the_process_umask(make_server, socket_dir, monkeypatch):
    """The mode is set on the path, not through the process-wide umask: the umask is the
    same before and after, never changes while servers start (seen from another
    thread), and files another thread creates meanwhile get the usual mode."""
    calls = []
    real_umask = os.umask
    monkeypatch.setattr(os, "umask", lambda mask: calls.append(mask) or real_umask(mask))
    before = umask_now()
    seen, modes = set(), set()
    starting = threading.Event()
    done = threading.Event()

    def watch():
        starting.wait(5)
        i = 0
        while not done.is_set():
            seen.add(umask_now())
            path = os.path.join(socket_dir, f"f{i}")
            with open(path, "w"):
                pass
            modes.add(stat.S_IMODE(os.stat(path).st_mode))
            os.unlink(path)
            i += 1

    watcher = threading.Thread(target=watch)
    watcher.start()
    starting.set()
    try:
        for i in range(5):
            server = make_server(os.path.join(socket_dir, f"s{i}.sock"))
            server.start()
            server.stop()
    finally:
        done.set()
        watcher.join(5)
    assert calls == []
    assert umask_now() == before
    assert seen == {before}
    assert modes == {0o666 & ~before}


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``sock`` (EOF or reset), or None."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(1024):
            pass
    except TimeoutError:
        return None
    except OSError:
        pass
    return time.monotonic() - start


def test_connections_over_the_cap_are_closed_at_once_counted_and_logged_once(make_server, caplog):
    """Two handlers busy and a cap of 2: five more connections are each closed at once
    (none waits for a handler), counted, and one warning names the burst; once a handler
    is free again, connections are served, and the burst's count is logged when it ends."""
    release = threading.Event()

    def busy(sock):
        if sock.recv(1024) == b"wait":
            release.wait(10)
        sock.sendall(b"done")

    caplog.set_level("INFO")
    server = make_server(handle=busy, max_connections=2, deadline_seconds=30)
    server.start()
    held = []
    for _ in range(2):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(server.socket_path)
        sock.sendall(b"wait")
        held.append(sock)
    time.sleep(0.2)  # both reach their handler
    try:
        for _ in range(5):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as extra:
                extra.connect(server.socket_path)
                took = closed_within(extra, 2.0)
                assert took is not None and took < 0.5, took
        assert server.refused_connections == 5
        warnings = [r for r in caplog.records if "connection cap" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelname == "WARNING"
        assert "test-server" in warnings[0].getMessage()
    finally:
        release.set()
    for sock in held:
        sock.settimeout(5)
        assert sock.recv(1024) == b"done"
        sock.close()
    time.sleep(0.2)
    assert ask(server.socket_path, b"again") == b"done"
    ended = [r for r in caplog.records if "closed 5 connections over" in r.getMessage()]
    assert len(ended) == 1


def test_a_trickling_client_is_cut_at_the_total_deadline(make_server):
    """A handler that reads with a generous per-call timeout and a client that sends a
    byte every 0.1 s, forever: the connection is cut at its total deadline all the same,
    and the handler's thread ends."""
    ended = threading.Event()

    def patient(sock):
        sock.settimeout(5)  # per recv: a trickle never trips it
        try:
            while sock.recv(1024):
                pass
        except OSError:
            pass
        finally:
            ended.set()

    server = make_server(handle=patient, deadline_seconds=0.5)
    server.start()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(server.socket_path)
        started = time.monotonic()
        cut = None
        while time.monotonic() - started < 5:
            try:
                sock.send(b"x")
            except OSError:
                cut = time.monotonic() - started
                break
            time.sleep(0.1)
    assert cut is not None and cut < 1.5, cut
    assert ended.wait(2)


def test_a_quick_client_is_not_affected_by_the_deadline(make_server):
    server = make_server(deadline_seconds=0.5)
    server.start()
    for i in range(20):
        assert ask(server.socket_path, b"%d" % i) == b"echo:%d" % i
