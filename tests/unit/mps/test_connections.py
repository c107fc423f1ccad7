"""Pins mps.connections with real processes and the real kernel: the connections a daemon
accepted on its control socket are found with their peer and the processes holding it, in
our network namespace and in a client's own; whether the daemon is blocked reading one and
what the client sent unread are read as the kernel shows them; holders are marked as the
node daemon's or the control daemon's by their parent chain; a stopped daemon is said to be
stopped, and a daemon that is gone or a socket file that cannot be read is a look's
problem, never an exception. Sockets of the daemon not accepted on the control socket (its
listener, another listener's connection) are not connections."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from mps import connections, proc
from mps.holders import READING, WRITING, Look
from mps.identity import DaemonIdentity

# A control daemon stand-in: listens at argv[1]; "read": accepts one connection and waits
# reading it; "write": accepts one and writes to it until it blocks; "idle": accepts and
# reads nothing; "own-client": as "read", its own child the client; "other": accepts on a
# second listener (argv[1] + "2") instead.
DAEMON = """
import os, socket, sys, time
path, mode = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.bind(path)
s.listen()
other = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
other.bind(path + "2")
other.listen()
if mode == "own-client" and os.fork() == 0:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c.connect(path)
    time.sleep(60)
    os._exit(0)
print("ready", flush=True)
conn, _ = (other if mode == "other" else s).accept()
while mode == "write":
    conn.send(b"answer" * 100)
if mode != "idle":
    conn.recvmsg(4096)
time.sleep(60)
"""
# A client: connects to argv[1], sends argv[2] if given, says so and stays.
CLIENT = """
import socket, sys, time
c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
c.connect(sys.argv[1])
if len(sys.argv) > 2:
    c.send(sys.argv[2].encode())
print("connected", flush=True)
time.sleep(60)
"""


@pytest.fixture
def pipe_dir():
    path = tempfile.mkdtemp(prefix="mpsc", dir="/tmp")  # short: unix socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def started():
    """Processes a test started, each in a session of its own: killed with all they started."""
    processes: list[subprocess.Popen] = []
    yield processes
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def start(started, argv: list[str], says: str) -> subprocess.Popen:
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    started.append(process)
    assert process.stdout.readline().strip() == says
    return process


def daemon(started, pipe_dir: str, mode: str = "read") -> DaemonIdentity:
    control = os.path.join(pipe_dir, "control")
    process = start(started, [sys.executable, "-I", "-c", DAEMON, control, mode], "ready")
    return DaemonIdentity(process.pid, proc.stat_of(process.pid).start_ticks)


def client(started, path: str, *extra: str, netns: bool = False) -> subprocess.Popen:
    argv = [sys.executable, "-I", "-c", CLIENT, path, *extra]
    return start(started, ["unshare", "-n", *argv] if netns else argv, "connected")


@pytest.fixture
def unrelated(started) -> int:
    """A PID that is no ancestor of anything here: the node daemon, as far as these tests go."""
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    started.append(process)
    return process.pid


def wait_look(identity, pipe_dir, ours, until, seconds: float = 5) -> Look:
    deadline = time.monotonic() + seconds
    while True:
        seen = connections.look(identity, pipe_dir, ours)
        if until(seen) or time.monotonic() > deadline:
            return seen
        time.sleep(0.02)


def reading(seen: Look) -> bool:
    return any(c.blocked == READING for c in seen.connections)


def test_a_silent_client_the_daemon_reads_from_is_found_with_its_holder(
    started, pipe_dir, unrelated
):
    """One connection: the daemon blocked reading it, nothing unread, held by the client
    (neither ours nor the daemon's)."""
    identity = daemon(started, pipe_dir)
    holder = client(started, os.path.join(pipe_dir, "control"))
    seen = wait_look(identity, pipe_dir, unrelated, reading)
    assert seen.problem is None and not seen.stopped
    [connection] = seen.connections
    assert connection.blocked == READING and connection.unread == 0 and connection.peer
    [found] = connection.holders
    assert found.pid == holder.pid and not found.ours and not found.daemons
    assert found.start_ticks == proc.stat_of(holder.pid).start_ticks


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root")
def test_a_client_in_a_network_namespace_of_its_own_is_found(started, pipe_dir, unrelated):
    """The accepted end lives in the client's namespace: it is found there all the same."""
    identity = daemon(started, pipe_dir)
    holder = client(started, os.path.join(pipe_dir, "control"), netns=True)
    seen = wait_look(identity, pipe_dir, unrelated, reading)
    [connection] = seen.connections
    assert connection.blocked == READING
    assert [h.pid for h in connection.holders] == [holder.pid]


# Receives one socket over the unix socket at argv[1] (SCM_RIGHTS), keeps it, says so.
RECEIVER = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1])
s.listen()
print("listening", flush=True)
conn, _ = s.accept()
_, fds, _, _ = socket.recv_fds(conn, 16, 1)
print("received", flush=True)
time.sleep(60)
"""
# Connects to argv[1] (from its own network namespace), hands the socket to the receiver
# at argv[2] and closes its own; then stays ("stay") or exits.
HANDER = """
import socket, sys, time
c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
c.connect(sys.argv[1])
r = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
r.connect(sys.argv[2])
socket.send_fds(r, [b"x"], [c.fileno()])
c.close()
print("connected", flush=True)
if sys.argv[3] == "stay":
    time.sleep(60)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root")
@pytest.mark.parametrize("hander", ["stay", "exit"])
def test_a_connection_passed_out_of_its_namespace_is_found_with_its_holder(
    started, pipe_dir, unrelated, hander
):
    """The client connects from a network namespace of its own, hands its socket to a
    process outside it and closes its own: nobody in that namespace holds it, so the rest
    of the process table is read, and the receiver is the holder. When the client also
    exits, no process is left in that namespace: the daemon's socket says where it is."""
    identity = daemon(started, pipe_dir)
    handoff = os.path.join(pipe_dir, "handoff")
    receiver = start(started, [sys.executable, "-I", "-c", RECEIVER, handoff], "listening")
    argv = ["unshare", "-n", sys.executable, "-I", "-c", HANDER, os.path.join(pipe_dir, "control")]
    hand = start(started, [*argv, handoff, hander], "connected")
    assert receiver.stdout.readline().strip() == "received"
    if hander == "exit":
        hand.wait(10)
    seen = wait_look(
        identity, pipe_dir, unrelated, lambda s: [h.pid for c in s.connections for h in c.holders]
    )
    assert [h.pid for c in seen.connections for h in c.holders] == [receiver.pid]


def test_what_a_client_sent_unread_is_counted_and_a_daemon_not_reading_awaits_nothing(
    started, pipe_dir, unrelated
):
    """A daemon that accepted and reads nothing: it is not blocked on the connection, and
    the bytes the client sent wait in it."""
    identity = daemon(started, pipe_dir, "idle")
    client(started, os.path.join(pipe_dir, "control"), "hello")
    seen = wait_look(identity, pipe_dir, unrelated, lambda s: bool(s.connections))
    [connection] = seen.connections
    assert connection.blocked is None and connection.unread == 5


def test_a_daemon_writing_to_a_client_that_reads_nothing_is_blocked_writing(
    started, pipe_dir, unrelated
):
    """The daemon blocked sending to a client whose socket is full: the connection is
    blocked WRITING, and what waits unread is in the client's end."""
    identity = daemon(started, pipe_dir, "write")
    client(started, os.path.join(pipe_dir, "control"))
    seen = wait_look(identity, pipe_dir, unrelated, lambda s: any(c.blocked for c in s.connections))
    [connection] = seen.connections
    assert connection.blocked == WRITING and connection.unread == 0
    assert connection.peer_unread is not None and connection.peer_unread > 0


def test_holders_are_marked_ours_or_the_daemons_by_their_parents(started, pipe_dir, unrelated):
    """A client started by the node daemon (here: this test) is ours; the daemon's own
    child is the daemon's."""
    identity = daemon(started, pipe_dir)
    client(started, os.path.join(pipe_dir, "control"))
    seen = wait_look(identity, pipe_dir, os.getpid(), reading)
    assert [h.ours for c in seen.connections for h in c.holders] == [True]
    own_dir = os.path.join(pipe_dir, "own")
    os.mkdir(own_dir)
    identity = daemon(started, own_dir, "own-client")
    seen = wait_look(identity, own_dir, unrelated, reading)
    assert [h.daemons for c in seen.connections for h in c.holders] == [True]


def test_another_listeners_connection_is_not_one_of_the_control_socket(
    started, pipe_dir, unrelated
):
    """Only sockets bound to the control socket's own file count: the daemon waiting on a
    connection of another listener has no control connection."""
    identity = daemon(started, pipe_dir, "other")
    client(started, os.path.join(pipe_dir, "control2"))
    time.sleep(0.3)
    seen = connections.look(identity, pipe_dir, unrelated)
    assert seen.problem is None and seen.connections == ()


def test_a_stopped_daemon_is_said_to_be_stopped(started, pipe_dir, unrelated):
    """SIGSTOP: the look says so (a stopped daemon waits on nobody)."""
    identity = daemon(started, pipe_dir)
    client(started, os.path.join(pipe_dir, "control"))
    wait_look(identity, pipe_dir, unrelated, reading)
    os.kill(identity.pid, signal.SIGSTOP)
    try:
        seen = wait_look(identity, pipe_dir, unrelated, lambda s: s.stopped)
        assert seen.stopped and seen.problem is None
    finally:
        os.kill(identity.pid, signal.SIGCONT)


def test_a_gone_daemon_or_an_unreadable_control_socket_is_a_problem(started, pipe_dir, unrelated):
    """Never an exception: the look names why it could not see."""
    identity = daemon(started, pipe_dir)
    reused = DaemonIdentity(identity.pid, identity.start_ticks + 1)
    assert "is gone" in connections.look(reused, pipe_dir, unrelated).problem
    elsewhere = os.path.join(pipe_dir, "nothing-here")
    assert "cannot be read" in connections.look(identity, elsewhere, unrelated).problem
