"""Tests of the stand-in ``standins/fakes/nvidia-cuda-mps-control`` itself.

The stand-in replaces NVIDIA's MPS control binary on machines without a GPU, so
these tests run it as a user (or the node daemon) would: ``-d`` and ``-f`` as
subprocesses with the MPS environment, commands through client mode on stdin.
What it shares with NVIDIA's real binary (start, directories, log format, the
answers gpushare-node parses) is pinned on both by tests/contract; these tests
cover the rest: detaching, the server processes, clients, ``ps``, per-server
settings, the stand-in-only ``sim_*`` controls, what ``quit`` and signals do to
servers, and a stale socket being replaced. Every daemon and server a test
starts is killed at its end. Linux only (/proc).

Why this module is longer than 400 lines: it pins the stand-in's whole dialect, command
by command, next to the contract tests against the real binary.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time

import pytest

from standins.paths import MPS_STANDIN

STANDIN = MPS_STANDIN
GPU = "GPU-5ad00000-0000-4000-8000-000000000000"
ALREADY_RUNNING = "An instance of this daemon is already running"
NO_DAEMON = "Cannot find MPS control daemon process"
LOG_LINE = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} Control +(\d+)\] (.*)")


def alive(pid: int) -> bool:
    """Running (a zombie left for a non-reaping init counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [arg.decode() for arg in f.read().split(b"\0") if arg]
    except OSError:
        return []


def wait_until(predicate, timeout: float = 5.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Mps:
    """One pipe and log directory, and the stand-in run against them."""

    def __init__(self):
        # Unix socket paths must stay under 108 bytes: keep the directory short.
        self.root = tempfile.mkdtemp(prefix="mps")
        self.pipe_dir = os.path.join(self.root, "pipe")  # created by the daemon
        self.log_dir = os.path.join(self.root, "log")
        self.socket_path = os.path.join(self.pipe_dir, "control")
        self.env = {
            **os.environ,
            "CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": self.log_dir,
            "CUDA_VISIBLE_DEVICES": GPU,
        }
        self.foreground: subprocess.Popen | None = None

    def run(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
        return subprocess.run(
            [STANDIN, *args],
            input=stdin,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=10,
        )

    def client(self, *lines: str) -> subprocess.CompletedProcess:
        return self.run(stdin="".join(line + "\n" for line in lines))

    def ask(self, line: str) -> str:
        """One command's answer (stdout); the client must succeed."""
        done = self.client(line)
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""
        return done.stdout

    def start(self) -> int:
        """``-d``; the daemon's PID."""
        done = self.run("-d")
        assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
        return int(self.ask("sim_pid"))

    def start_server(self, uid: int = 1000) -> int:
        assert self.ask(f"start_server -uid {uid}") == ""
        return int(self.ask("get_server_list"))

    def log(self) -> str:
        try:
            with open(os.path.join(self.log_dir, "control.log")) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def log_texts(self) -> list[str]:
        return [LOG_LINE.fullmatch(line).group(2) for line in self.log().splitlines()]

    def commands_and_answers(self) -> list[str]:
        """The log's texts without the per-connection lines."""
        skip = ("Accepting connection...", "NEW UI", "UI closed")
        return [text for text in self.log_texts() if text not in skip]

    def cleanup(self) -> None:
        if self.foreground is not None and self.foreground.poll() is None:
            self.foreground.kill()
            self.foreground.wait()
        log = self.log()
        for pid in {int(p) for p in re.findall(r"Control +(\d+)\]", log)}:
            if alive(pid) and STANDIN in cmdline(pid):
                os.kill(pid, signal.SIGKILL)
        for pid in {int(p) for p in re.findall(r"Starting new server (\d+)", log)}:
            if alive(pid) and cmdline(pid)[:1] == ["nvidia-cuda-mps-server"]:
                os.killpg(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def mps():
    instance = Mps()
    yield instance
    instance.cleanup()


@pytest.fixture
def daemon(mps):
    """A running background daemon: (Mps, its PID)."""
    return mps, mps.start()


def test_background_start_returns_once_listening_and_detaches(mps):
    assert not os.path.exists(mps.pipe_dir) and not os.path.exists(mps.log_dir)
    done = mps.run("-d")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    # Listening already: no retry needed.
    assert stat.S_ISSOCK(os.stat(mps.socket_path).st_mode)
    assert mps.ask("get_server_list") == ""
    pid = int(mps.ask("sim_pid"))
    assert alive(pid)
    # Its own session and process group, away from the starter's.
    assert os.getsid(pid) != os.getsid(0)
    assert os.getpgid(pid) != os.getpgrp()
    assert parent_of(pid) != os.getpid()
    assert os.readlink(f"/proc/{pid}/cwd") == os.getcwd()  # kept, as the real one keeps it
    assert [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (0, 1, 2)] == ["/dev/null"] * 3
    # Found the way the node daemon finds it: "-d" in its command line, its pipe dir in its env.
    assert "-d" in cmdline(pid) and os.path.basename(STANDIN) in map(
        os.path.basename, cmdline(pid)[:2]
    )
    with open(f"/proc/{pid}/environ", "rb") as f:
        assert f"CUDA_MPS_PIPE_DIRECTORY={mps.pipe_dir}".encode() in f.read().split(b"\0")


def test_daemon_survives_a_kill_of_its_starters_whole_process_group(mps):
    starter = subprocess.Popen(
        ["/bin/sh", "-c", '"$0" -d && exec sleep 30', STANDIN],
        env=mps.env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: mps.client("sim_pid").returncode == 0, what="the daemon")
        pid = int(mps.ask("sim_pid"))
        os.killpg(starter.pid, signal.SIGKILL)
        assert starter.wait(5) == -signal.SIGKILL
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
    time.sleep(0.2)
    assert alive(pid)
    assert mps.ask("sim_pid") == f"{pid}\n"


def test_second_daemon_is_refused_while_one_answers(daemon):
    mps, pid = daemon
    for flag in ("-d", "-f"):
        done = mps.run(flag)
        assert done.returncode == 1
        assert ALREADY_RUNNING in done.stdout
    assert mps.ask("sim_pid") == f"{pid}\n"
    assert mps.log().count("Starting control daemon") == 1


def test_client_without_a_daemon_fails(mps):
    done = mps.client("get_server_list")
    assert done.returncode == 1
    assert done.stdout == ""
    assert NO_DAEMON in done.stderr


def test_several_commands_in_one_client_run_answer_in_order(daemon):
    mps, pid = daemon
    done = mps.client("sim_pid", "", "get_default_active_thread_percentage", "frobnicate 3")
    assert done.returncode == 0
    assert done.stdout == f'{pid}\nUnknown command ""\n100.0\nUnknown command "frobnicate"\n'


def test_start_server_runs_one_real_server_process_of_one_user(daemon):
    mps, pid = daemon
    server = mps.start_server(1000)
    assert alive(server) and parent_of(server) == pid
    argv = cmdline(server)
    assert argv[0] == "nvidia-cuda-mps-server" and "-d" not in argv and "-f" not in argv
    assert mps.ask(f"get_server_status {server}") == "ACTIVE\n"
    assert mps.ask("start_server -uid 1000") == ""  # that user's server already runs
    assert mps.ask("start_server -uid 1001") == "Error: server for another user is running\n"
    assert mps.ask("get_server_list") == f"{server}\n"
    assert mps.ask("get_server_status 999999") == "Server 999999 not found\n"
    assert mps.ask("start_server 1000") == "A user id (UID) is required to start a new server\n"


def test_clients_ps_and_terminate_client(daemon):
    mps, _ = daemon
    assert mps.ask("ps") == "Server not found\n"
    server = mps.start_server()
    assert mps.ask(f"get_client_list {server}") == ""
    assert mps.ask("ps") == ""
    assert mps.ask(f"sim_add_client {server} 4242") == ""
    assert mps.ask(f"sim_add_client {server} 4343") == ""
    assert mps.ask(f"get_client_list {server}") == "4242\n4343\n"
    assert mps.ask("ps") == f"4242 {server} {GPU}\n4343 {server} {GPU}\n"
    assert mps.ask("ps -p 4343") == f"4343 {server} {GPU}\n"
    assert mps.ask(f"terminate_client {server} 4242") == ""
    assert mps.ask(f"get_client_list {server}") == "4343\n"
    assert mps.ask(f"terminate_client {server} 4242").startswith("Error: client 4242 not found")
    assert mps.ask("terminate_client 999999 4343") == "Server 999999 not found\n"
    assert mps.ask("get_client_list 999999") == "Server 999999 not found\n"
    assert mps.ask("sim_add_client 999999 1") == "Server 999999 not found\n"


def test_active_thread_percentages(daemon):
    mps, _ = daemon
    assert mps.ask("get_default_active_thread_percentage") == "100.0\n"
    early = mps.start_server()
    assert mps.ask("set_default_active_thread_percentage 30") == "30.0\n"
    assert mps.ask("get_default_active_thread_percentage") == "30.0\n"
    # Defaults only reach servers started after the change.
    assert mps.ask(f"get_active_thread_percentage {early}") == "100.0\n"
    assert mps.ask(f"sim_server_exit {early}") == ""
    late = mps.start_server()
    assert mps.ask(f"get_active_thread_percentage {late}") == "30.0\n"
    assert mps.ask(f"set_active_thread_percentage {late} 12.5") == "12.5\n"
    assert mps.ask(f"get_active_thread_percentage {late}") == "12.5\n"
    assert mps.ask("get_default_active_thread_percentage") == "30.0\n"
    for bad in ("0", "100.5", "-5", "abc", "nan", "inf", ""):  # refused: the kept value
        assert mps.ask(f"set_default_active_thread_percentage {bad}") == "30.0\n"
        assert mps.ask(f"set_active_thread_percentage {late} {bad}") == "12.5\n"
    assert mps.ask("get_active_thread_percentage 999999") == "Server 999999 not found\n"


def test_pinned_memory_limits_read_back_in_whole_gib(daemon):
    mps, _ = daemon
    assert mps.ask("get_default_device_pinned_mem_limit 0") == ""
    assert mps.ask("set_default_device_pinned_mem_limit 0 4096M") == ""
    assert mps.ask("get_default_device_pinned_mem_limit 0") == "4G\n"
    assert mps.ask(f"set_default_device_pinned_mem_limit {GPU} 15360M") == ""
    assert mps.ask(f"get_default_device_pinned_mem_limit {GPU}") == "15G\n"  # kept by name
    assert mps.ask("get_default_device_pinned_mem_limit 1") == ""
    server = mps.start_server()  # takes the defaults current at its start
    assert mps.ask(f"get_device_pinned_mem_limit {server} 0") == "4G\n"
    assert mps.ask(f"set_device_pinned_mem_limit {server} 0 1536M") == ""
    assert mps.ask(f"get_device_pinned_mem_limit {server} 0") == "1G\n"  # rounded down
    assert mps.ask(f"set_device_pinned_mem_limit {server} 0 512M") == ""
    assert mps.ask(f"get_device_pinned_mem_limit {server} 0") == "512M\n"
    assert mps.ask(f"set_device_pinned_mem_limit {server} 0 0M") == ""  # removed
    assert mps.ask(f"get_device_pinned_mem_limit {server} 0") == ""
    assert mps.ask("get_default_device_pinned_mem_limit 0") == "4G\n"
    assert mps.ask("set_device_pinned_mem_limit 999999 0 2G") == "Server 999999 not found\n"
    assert "No default pinned memory limit set for the device!" in mps.log_texts()


def test_server_status_set_by_sim_command(daemon):
    mps, _ = daemon
    server = mps.start_server()
    for state in ("FAULT", "INITIALIZING", "ACTIVE"):
        assert mps.ask(f"sim_set_server_status {server} {state}") == ""
        assert mps.ask(f"get_server_status {server}") == f"{state}\n"
    assert mps.ask(f"sim_set_server_status {server} BROKEN").startswith("Error: usage")
    assert mps.ask("sim_set_server_status 999999 FAULT") == "Server 999999 not found\n"


def test_a_server_that_dies_is_dropped_and_reaped(daemon):
    mps, _ = daemon
    server = mps.start_server()
    assert mps.ask(f"sim_server_exit {server}") == ""
    assert mps.ask("get_server_list") == ""
    assert not os.path.exists(f"/proc/{server}")  # killed and reaped: no zombie
    assert mps.ask(f"get_server_status {server}") == f"Server {server} not found\n"
    # One that dies on its own goes too, even with nobody asking.
    other = mps.start_server(1001)  # no server runs now, so another user may start one
    os.kill(other, signal.SIGKILL)
    wait_until(lambda: not os.path.exists(f"/proc/{other}"), what="the server reaped")
    assert mps.ask("get_server_list") == ""
    assert f"Server {other} exited with status 1" in mps.log_texts()


def test_quit_stops_servers_and_the_daemon_and_forgets_defaults(daemon):
    mps, pid = daemon
    server = mps.start_server()
    assert mps.ask(f"sim_add_client {server} 77") == ""
    assert mps.ask("set_default_active_thread_percentage 40") == "40.0\n"
    assert mps.ask("quit") == ""
    assert not alive(server)  # killed by the time quit answers
    wait_until(lambda: not alive(pid), what="the daemon gone")
    assert stat.S_ISSOCK(os.stat(mps.socket_path).st_mode)  # left behind, as the real one does
    done = mps.client("get_server_list")
    assert done.returncode == 1 and NO_DAEMON in done.stderr
    assert mps.log_texts()[-1] == "Exit with status 0"
    mps.start()
    assert mps.ask("get_default_active_thread_percentage") == "100.0\n"
    assert mps.ask("get_server_list") == ""


def test_control_log_records_start_commands_answers_and_servers(daemon):
    mps, pid = daemon
    assert mps.ask("set_default_device_pinned_mem_limit 0 15360M") == ""
    assert mps.ask("get_default_active_thread_percentage") == "100.0\n"
    server = mps.start_server()
    assert mps.ask(f"sim_add_client {server} 5") == ""
    assert mps.ask(f"sim_add_client {server} 6") == ""
    assert mps.ask(f"get_client_list {server}") == "5\n6\n"
    lines = mps.log().splitlines()
    matches = [LOG_LINE.fullmatch(line) for line in lines]
    assert all(matches), lines
    assert {int(m.group(1)) for m in matches} == {pid}
    texts = mps.commands_and_answers()
    assert texts[:2] == [
        f"Starting control daemon using socket {mps.socket_path}",
        f"To connect CUDA applications to this daemon, set env "
        f"CUDA_MPS_PIPE_DIRECTORY={mps.pipe_dir}",
    ]
    assert texts[texts.index("Cmd:get_default_active_thread_percentage") + 1] == "100.0"
    at = texts.index(f"Cmd:get_client_list {server}")
    assert texts[at : at + 3] == [f"Cmd:get_client_list {server}", "5", "6"]
    assert f"Starting new server {server} for user 1000" in texts
    assert "Cmd:set_default_device_pinned_mem_limit 0 15360M" in texts
    assert mps.log_texts().count("NEW UI") == mps.log_texts().count("UI closed")


def test_quit_is_taken_only_on_the_privileged_socket(daemon):
    mps, pid = daemon
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(mps.socket_path)  # what a non-root client uses
        conn.sendall(b"quit\n")
        assert conn.recv(4096) == b"Not enough privilege to execute quit command\n"
    assert alive(pid) and mps.ask("sim_pid") == f"{pid}\n"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_foreground_daemon_dies_of_signals_and_its_servers_follow(mps, signum):
    mps.foreground = subprocess.Popen(
        [STANDIN, "-f"],
        env=mps.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: mps.client("sim_pid").returncode == 0, what="the foreground daemon")
    assert mps.ask("sim_pid") == f"{mps.foreground.pid}\n"  # no fork
    server = mps.start_server()
    mps.foreground.send_signal(signum)
    assert mps.foreground.wait(5) == -signum  # the default action, as the real one
    out, err = mps.foreground.communicate()
    assert err == ""
    assert f"Starting new server {server} for user 1000" in out  # the log goes to stdout
    assert mps.log() == ""
    assert stat.S_ISSOCK(os.stat(mps.socket_path).st_mode)
    wait_until(lambda: not alive(server), what="the server gone")


def test_killed_daemon_leaves_a_stale_socket_that_a_new_start_replaces(daemon):
    mps, pid = daemon
    server = mps.start_server()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid), what="the daemon killed")
    assert stat.S_ISSOCK(os.stat(mps.socket_path).st_mode)  # left behind
    done = mps.client("get_server_list")
    assert done.returncode == 1 and NO_DAEMON in done.stderr
    # Its orphaned server notices and exits by itself.
    wait_until(lambda: not alive(server), what="the orphaned server gone")
    new_pid = mps.start()
    assert new_pid != pid
    assert mps.ask("get_server_list") == ""
    assert mps.log().count("Starting control daemon") == 2


def test_a_hung_client_does_not_block_others(daemon):
    mps, pid = daemon
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hung:
        hung.connect(mps.socket_path)  # connects and never sends a line
        started = time.monotonic()
        assert mps.ask("sim_pid") == f"{pid}\n"
        assert time.monotonic() - started < 2
