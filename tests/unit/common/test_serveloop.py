"""Pins nodemgr.common.serveloop.ServeLoop: connections are served until ``stop()``, which
ends the loop at once (also before it began, and twice); an idle loop never wakes up
(no poll interval); the wake pipe is closed when the loop ends."""

import os
import shutil
import socket
import socketserver
import tempfile
import threading

import pytest

from nodemgr.common.serveloop import ServeLoop
from standins.threadstats import wakeups_while_idle


class Echo(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.sendall(b"echo:" + self.request.recv(64))


@pytest.fixture
def server():
    directory = tempfile.mkdtemp(dir="/tmp", prefix="gs-loop-")
    srv = socketserver.ThreadingUnixStreamServer(os.path.join(directory, "s"), Echo)
    yield srv
    srv.server_close()
    shutil.rmtree(directory, ignore_errors=True)


def ask(path: str) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        sock.sendall(b"hi")
        return sock.recv(64)


def serving(loop: ServeLoop) -> threading.Thread:
    thread = threading.Thread(target=loop.serve, daemon=True)
    thread.start()
    return thread


def test_serves_until_stopped_and_stop_ends_it_at_once(server):
    """Requests are answered; stop() ends serve() without waiting for any interval."""
    loop = ServeLoop(server)
    thread = serving(loop)
    assert ask(server.server_address) == b"echo:hi"
    assert ask(server.server_address) == b"echo:hi"
    loop.stop()
    thread.join(2)
    assert not thread.is_alive()
    loop.stop()  # twice: harmless, the pipe is closed


def test_an_idle_loop_never_wakes_up(server):
    """Blocked in select with no timeout: no wake-up in a quiet spell (serve_forever's poll
    interval woke it every 0.1-0.5 s)."""
    loop = ServeLoop(server)
    thread = serving(loop)
    try:
        assert wakeups_while_idle(thread) == 0
    finally:
        loop.stop()
        thread.join(2)


def test_a_stop_before_serving_makes_serve_return_at_once(server):
    """stop() may race ahead of the thread's start: serve() then returns without serving."""
    loop = ServeLoop(server)
    loop.stop()
    thread = serving(loop)
    thread.join(2)
    assert not thread.is_alive()


def test_the_wake_pipe_is_closed_when_the_loop_ends(server):
    """No descriptor is left behind by a loop that served, nor by one that never did."""
    before = set(os.listdir("/proc/self/fd"))
    loop = ServeLoop(server)
    thread = serving(loop)
    loop.stop()
    thread.join(2)
    ServeLoop(server).close()
    assert set(os.listdir("/proc/self/fd")) <= before
