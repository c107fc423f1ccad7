"""Pins how mps.proc finds a card's control daemon in /proc, with real processes: only the
process that holds the listening socket of the pipe directory, runs the control binary,
as our user, in our mount namespace or one given as trusted (the card's own); never one
that only poses (same path in another mount namespace, another user, another program);
and every read fails closed: a process that vanishes mid-read, a file over its cap, a
/proc/net/unix that cannot be read or a line that is not the kernel's leaves that
process out, never raises."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from mps import proc
from mps.identity import DaemonIdentity

# A stand-in control daemon: listens at argv[1] and holds its own file open (a script's
# exe is its interpreter; holding the script is how it shows it runs it).
DAEMON = """#!{python}
import os, socket, sys, time
own = open(os.path.realpath(__file__), "rb")
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1])
s.listen()
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def root():
    path = tempfile.mkdtemp(prefix="mpsp", dir="/tmp")  # short: unix socket paths
    os.chmod(path, 0o755)
    os.mkdir(os.path.join(path, "pipe"))
    os.chmod(os.path.join(path, "pipe"), 0o777)  # any user may bind there
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def started():
    """Processes a test started, each in a session of its own: killed with all they started."""
    processes: list[subprocess.Popen] = []
    yield processes
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def program(root: str, name: str = "nvidia-cuda-mps-control", python=sys.executable) -> str:
    path = os.path.join(root, name)
    with open(path, "w") as f:
        f.write(DAEMON.format(python=python))
    os.chmod(path, 0o755)
    return path


def run(started, argv: list[str], **kwargs) -> int:
    """Start ``argv`` (a daemon above); its PID once it listens."""
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    )
    started.append(process)
    assert process.stdout.readline() == "ready\n"
    return process.pid


def control(root: str) -> str:
    return os.path.join(root, "pipe", "control")


def start_ticks(pid: int) -> int:
    stat = proc.stat_of(pid)
    assert stat is not None
    return stat.start_ticks


def test_the_process_holding_the_socket_and_running_the_binary_is_found(root, started):
    """Found with its start time; gone, nothing is found."""
    binary = program(root)
    pid = run(started, [binary, control(root)])
    assert proc.find_daemon(os.path.join(root, "pipe"), binary) == DaemonIdentity(
        pid, start_ticks(pid)
    )
    os.killpg(pid, signal.SIGKILL)
    started.pop().wait()
    assert proc.find_daemon(os.path.join(root, "pipe"), binary) is None


def test_a_holder_running_another_program_is_not_the_daemon(root, started):
    """The socket is held by a process that runs another file (its own copy named the
    same, say): not the daemon."""
    binary = program(root)
    other = program(root, "copy")
    run(started, [other, control(root)], executable=other)
    assert proc.find_daemon(os.path.join(root, "pipe"), binary) is None


def test_the_binary_listening_elsewhere_is_not_the_daemon(root, started):
    """A process of the control binary that listens at another path is not the daemon of
    this pipe directory."""
    binary = program(root)
    run(started, [binary, os.path.join(root, "control")])
    assert proc.find_daemon(os.path.join(root, "pipe"), binary) is None


def test_two_unrelated_holders_are_no_daemon(root, started):
    """Two processes that each pass (one bound the path, one inherited nothing but bound
    it again after it was removed): none is taken."""
    binary = program(root)
    run(started, [binary, control(root)])
    os.unlink(control(root))
    run(started, [binary, control(root)])
    assert proc.find_daemon(os.path.join(root, "pipe"), binary) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a mount namespace")
def test_a_holder_in_another_mount_namespace_is_not_the_daemon(root, started):
    """The binary itself, as root, listening at the very path string, but in a mount
    namespace of its own (as in a container, which always has one): not the daemon."""
    binary = program(root)
    run(started, ["unshare", "--mount", binary, control(root)])
    assert proc.listening_at(control(root))  # it listens there, as /proc/net/unix says
    assert proc.find_daemon(os.path.join(root, "pipe"), binary) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a mount namespace")
def test_a_holder_in_a_trusted_mount_namespace_is_the_daemon(root, started):
    """The same holder in a mount namespace of its own is the daemon when that namespace is
    given as trusted (a card's own, as mps.namespace keeps it), and only then."""
    binary = program(root)
    pid = run(started, ["unshare", "--mount", binary, control(root)])
    pipe = os.path.join(root, "pipe")
    assert proc.find_daemon(pipe, binary) is None
    found = proc.find_daemon(pipe, binary, namespaces=(proc.mount_ns(pid),))
    assert found == DaemonIdentity(pid, start_ticks(pid))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_a_holder_of_another_user_is_not_the_daemon(root, started):
    """The binary listening at the path as another user than ours: not the daemon."""
    python = shutil.which("python3", path="/usr/bin:/bin")  # one that user may run
    if python is None:
        pytest.skip("no system python3 that another user may run")
    binary = program(root, python=python)
    run(started, [binary, control(root)], user="nobody")
    assert proc.listening_at(control(root))
    assert proc.find_daemon(os.path.join(root, "pipe"), binary) is None


def test_a_path_that_is_not_utf8_is_matched(started):
    """A pipe directory whose name holds bytes that are not UTF-8 still matches."""
    base = tempfile.mkdtemp(prefix="mpsp", dir="/tmp")
    try:
        pipe = os.path.join(os.fsencode(base), b"\xff")
        os.mkdir(pipe)
        binary = program(base)
        pid = run(started, [binary, os.fsdecode(os.path.join(pipe, b"control"))])
        found = proc.find_daemon(os.fsdecode(pipe), binary)
        assert found is not None and found.pid == pid
    finally:
        shutil.rmtree(base, ignore_errors=True)


def failing_open(monkeypatch, path_suffix: str, error: Exception | None = None, data=None):
    """Make reads of files ending in ``path_suffix`` raise ``error`` or return ``data``."""
    real_open = proc._open

    def fake(path, *args, **kwargs):
        if str(path).endswith(path_suffix):
            if error is not None:
                raise error
            return io.BytesIO(data)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(proc, "_open", fake)


def test_a_daemon_whose_status_vanishes_mid_search_is_left_out(root, started, monkeypatch):
    """Its status gone while read (it exited): left out, no error."""
    binary = program(root)
    pid = run(started, [binary, control(root)])
    failing_open(monkeypatch, f"/{pid}/status", FileNotFoundError(2, "gone"))
    assert proc.find_daemon(os.path.join(root, "pipe"), binary) is None


@pytest.mark.parametrize("name", ["status", "stat"])
def test_a_file_over_its_cap_leaves_the_process_out(root, started, monkeypatch, name):
    """A status or stat larger than the kernel writes: not read whole, not the daemon."""
    binary = program(root)
    pid = run(started, [binary, control(root)])
    failing_open(monkeypatch, f"/{pid}/{name}", data=b"Uid:\t0\t0\t0\t0\n" * 100_000)
    assert proc.find_daemon(os.path.join(root, "pipe"), binary) is None


def test_an_unreadable_net_unix_finds_no_daemon(root, started, monkeypatch):
    binary = program(root)
    run(started, [binary, control(root)])
    failing_open(monkeypatch, "/net/unix", PermissionError(13, "denied"))
    assert proc.find_daemon(os.path.join(root, "pipe"), binary) is None


def test_a_process_holding_too_many_files_is_not_looked_through(root, started, monkeypatch):
    binary = program(root)
    run(started, [binary, control(root)])
    monkeypatch.setattr(proc, "MAX_FDS", 2)
    assert proc.find_daemon(os.path.join(root, "pipe"), binary) is None


def test_overlong_net_unix_lines_are_skipped_whole():
    """A line longer than any the kernel writes is dropped, with its tail, not split."""
    listen = b"0000000000000000: 00000002 00000000 00010000 0005 01 101 /p/control\n"
    data = b"x" * 5000 + b" " + listen + listen
    assert list(proc._lines(io.BytesIO(data))) == [listen]


def test_children_are_found_without_children_files(started, monkeypatch):
    """Where the kernel has no /proc/PID/task/TID/children, every parent field is read."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '60'])"],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    started.append(parent)
    expected = []
    for _ in range(200):
        expected = proc.children_of(parent.pid) or []
        if expected:
            break
        subprocess.run(["sleep", "0.02"])
    real_exists = os.path.exists
    monkeypatch.setattr(
        proc.os.path, "exists", lambda p: False if p.endswith("/children") else real_exists(p)
    )
    assert expected and proc.children_of(parent.pid) == expected


SERVER = "#!/bin/sh\nwhile :; do sleep 1; done\n"


def parent_of_server(root: str, started, server_name: str = "nvidia-cuda-mps-server"):
    """A stand-in daemon that started one server (the file ``server_name`` next to the
    control binary): (the daemon's identity, the server's PID)."""
    server = os.path.join(root, server_name)
    with open(server, "w") as f:
        f.write(SERVER)
    os.chmod(server, 0o755)
    script = (
        f"import subprocess, time\np = subprocess.Popen([{server!r}])\n"
        "print(p.pid, flush=True)\ntime.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    started.append(parent)
    child = int(parent.stdout.readline())
    for _ in range(200):  # until the child runs the server (exec'd, the file held open)
        held = proc.held_by(child, files=True)
        if held is not None and proc.file_id(server) in held[1]:
            break
        subprocess.run(["sleep", "0.02"])
    return DaemonIdentity(parent.pid, start_ticks(parent.pid)), child


def test_the_servers_are_the_daemons_children_running_the_server(root, started):
    """A child running the server file next to the control binary is a server, named with
    its start time; a child running another file is not; a daemon identity whose start
    time is not the process's (its PID reused) has none."""
    binary = program(root)
    daemon, server = parent_of_server(root, started)
    assert proc.find_servers(daemon, binary) == {(server, start_ticks(server))}
    other, _ = parent_of_server(root, started, "something-else")
    assert proc.find_servers(other, binary) == frozenset()
    stale = DaemonIdentity(daemon.pid, daemon.start_ticks + 1)
    assert proc.find_servers(stale, binary) == frozenset()


def test_a_daemon_environ_over_its_cap_still_finds_servers_next_to_the_binary(
    root, started, monkeypatch
):
    """The daemon's PATH cannot be read (environ larger than the kernel's cap here): only
    the server next to the control binary counts, and it is found."""
    binary = program(root)
    daemon, server = parent_of_server(root, started)
    failing_open(monkeypatch, f"/{daemon.pid}/environ", data=b"A=" + b"x" * (2 << 20))
    assert proc.find_servers(daemon, binary) == {(server, start_ticks(server))}


def test_a_server_that_vanishes_while_read_is_no_server(root, started, monkeypatch):
    """Its stat gone mid-read: not a server, no error (the watchdog then judges it)."""
    binary = program(root)
    daemon, server = parent_of_server(root, started)
    failing_open(monkeypatch, f"/{server}/stat", ProcessLookupError(3, "gone"))
    assert proc.find_servers(daemon, binary) == frozenset()


def test_unreadable_children_give_no_servers(root, started, monkeypatch):
    """The daemon's children file unreadable (not the kernel's format here): no servers."""
    binary = program(root)
    daemon, _ = parent_of_server(root, started)
    failing_open(monkeypatch, f"/task/{daemon.pid}/children", data=b"12 \xff")
    assert proc.find_servers(daemon, binary) == frozenset()


def test_a_daemon_verified_before_is_checked_alone_without_walking_the_process_table(
    root, started, monkeypatch
):
    """At each health check the previous daemon is re-verified on its own (a walk of every
    /proc/PID was the supervisor's idle cost); once it fails, the walk runs again."""
    binary = program(root)
    pid = run(started, [binary, control(root)])
    known = proc.find_daemon(os.path.join(root, "pipe"), binary)
    assert known == DaemonIdentity(pid, start_ticks(pid))
    walks = []
    real_pids = proc.pids
    monkeypatch.setattr(proc, "pids", lambda: walks.append(1) or real_pids())
    assert proc.find_daemon(os.path.join(root, "pipe"), binary, known) == known
    assert walks == []
    stale = DaemonIdentity(pid, start_ticks(pid) + 1)  # same PID, another process
    assert proc.find_daemon(os.path.join(root, "pipe"), binary, stale) == known
    assert walks == [1]
