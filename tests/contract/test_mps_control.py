"""Contract of the MPS control binary: every test runs on the stand-in
(standins/fakes/nvidia-cuda-mps-control) and on NVIDIA's real binary (Debian
12 driver 535, fetched by scripts/setup-real-parts; its control daemon runs
without a GPU). They pin the commands gpushare-node sends (mps/), the answers it
parses (mps/control.py), the pipe and log directories, and the mps library
driving each binary. What the real one showed is in docs/real-parts.md.

Every daemon a test starts is killed at its end (found in /proc by its pipe
directory), and the module checks that none is left.

Why this module is longer than 400 lines: it is the one contract module the project
promises: every command gpushare-node sends and every answer it parses, each against
both the stand-in and NVIDIA's binary.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from mps import CardDaemon, DaemonIdentity, HealthState, MpsProtocolError, MpsUnsupported
from standins import real_parts
from standins.paths import MPS_STANDIN

GPU = "GPU-5ad00000-0000-4000-8000-000000000000"
NO_DAEMON = "Cannot find MPS control daemon process"
NO_PRIVILEGE = "Not enough privilege to execute quit command"
ALREADY_RUNNING = "An instance of this daemon is already running"
LOG_LINE = re.compile(
    r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} Control (?=[ \d]{5,}\])( *\d+)\] (.*)"
)
ROOTS: list[str] = []  # every directory a test ran daemons in, checked at the end


@pytest.fixture(scope="module", params=["stand-in", "real"])
def binary(request) -> str:
    if request.param == "real":
        return real_parts.require().mps_control
    return MPS_STANDIN


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind():
    yield
    left = [p for root in ROOTS for p in processes_under(root)]
    for proc in left:
        proc.kill()
    assert not left, f"daemons left running: {left}"


def processes_under(root: str) -> list[psutil.Process]:
    """Processes whose CUDA_MPS_PIPE_DIRECTORY lies under ``root`` (daemons, servers)."""
    found = []
    for proc in psutil.process_iter():
        try:
            pipe = proc.environ().get("CUDA_MPS_PIPE_DIRECTORY", "")
            if pipe.startswith(root + "/") and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def gone(proc: psutil.Process) -> bool:
    """Exited (a zombie that init has not reaped yet counts as gone)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(proc: psutil.Process) -> None:
    wait_until(lambda: gone(proc), what=f"process {proc.pid} gone")


def wait_until(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Mps:
    """A pipe and a log directory, and the binary run against them."""

    def __init__(self, binary: str):
        self.binary = binary
        # Unix socket paths must stay under 108 bytes: keep the directory short.
        self.root = tempfile.mkdtemp(prefix="mpsc")
        ROOTS.append(self.root)
        self.pipe_dir = os.path.join(self.root, "pipe")
        self.log_dir = os.path.join(self.root, "log")
        self.env = {
            **os.environ,
            "CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": self.log_dir,
            "CUDA_VISIBLE_DEVICES": GPU,
        }
        self.foreground: subprocess.Popen | None = None

    @property
    def is_real(self) -> bool:
        return self.binary != MPS_STANDIN

    def run(self, *args: str, stdin: str = "", **kwargs) -> subprocess.CompletedProcess:
        """The binary with ``args``; run as another ``user``, from a copy that user can
        reach (the checkout may lie under a directory only its owner may enter, as root's
        home is)."""
        binary = self.binary if kwargs.get("user") is None else self._reachable_copy()
        return subprocess.run(
            [binary, *args],
            input=stdin,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=20,
            **kwargs,
        )

    def _reachable_copy(self) -> str:
        """The binary copied, under its own name, into a directory every user may enter."""
        directory = os.path.join(self.root, "bin")
        copy = os.path.join(directory, os.path.basename(self.binary))
        if not os.path.exists(copy):
            os.makedirs(directory, exist_ok=True)
            shutil.copy(self.binary, copy)
            os.chmod(directory, 0o755)
            os.chmod(copy, 0o755)
        return copy

    def client(self, *lines: str, **kwargs) -> subprocess.CompletedProcess:
        return self.run(stdin="".join(line + "\n" for line in lines), **kwargs)

    def ask(self, line: str) -> str:
        """One command's answer (stdout); the client must exit 0 with nothing on stderr."""
        done = self.client(line)
        assert (done.returncode, done.stderr) == (0, ""), done
        return done.stdout

    def start(self) -> psutil.Process:
        """``-d``; the daemon's process."""
        done = self.run("-d")
        assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
        return self.daemon()

    def daemon(self) -> psutil.Process:
        """The control daemon serving this pipe directory (found by its argv and env: the
        test's own lookup, independent of how mps.CardDaemon verifies it)."""
        name = os.path.basename(self.binary)

        def argv(p: psutil.Process) -> list[str]:
            # A process may exit between the listing and this read (a short-lived client).
            try:
                return p.cmdline()
            except psutil.NoSuchProcess:
                return []

        def one():
            found = [
                p
                for p in processes_under(self.root)
                if name in map(os.path.basename, argv(p)[:2]) and {"-d", "-f"} & set(argv(p))
            ]
            return found[0] if len(found) == 1 else None

        return wait_until(one, what="the control daemon in /proc")

    def log(self) -> str:
        try:
            with open(os.path.join(self.log_dir, "control.log")) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def log_texts(self) -> list[str]:
        return [LOG_LINE.fullmatch(line).group(2) for line in self.log().splitlines()]

    def cleanup(self) -> None:
        if self.foreground is not None and self.foreground.poll() is None:
            self.foreground.kill()
            self.foreground.wait()
        for proc in processes_under(self.root):
            try:
                proc.kill()
            except psutil.Error:
                pass
            wait_gone(proc)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def mps(binary):
    instance = Mps(binary)
    yield instance
    instance.cleanup()


@pytest.fixture
def daemon(mps):
    """A running background daemon: (Mps, its process)."""
    return mps, mps.start()


def mode(path: str) -> tuple[str, int]:
    st = os.lstat(path)
    kind = {
        stat.S_ISSOCK: "socket",
        stat.S_ISFIFO: "fifo",
        stat.S_ISDIR: "dir",
        stat.S_ISREG: "file",
    }
    return next(name for test, name in kind.items() if test(st.st_mode)), stat.S_IMODE(st.st_mode)


# Starting and stopping the control daemon


def test_start_returns_once_listening_and_detaches(mps):
    """-d exits 0 with no output once the daemon listens; the daemon runs in its own
    session with -d in its command line and the MPS env in /proc."""
    done = mps.run("-d")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert mps.ask("get_server_list") == ""  # answers at once: no retry needed
    proc = mps.daemon()
    assert proc.ppid() != os.getpid()
    assert os.getsid(proc.pid) != os.getsid(0) and os.getpgid(proc.pid) != os.getpgrp()
    assert [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in (0, 1, 2)] == ["/dev/null"] * 3
    environ = proc.environ()
    assert environ["CUDA_MPS_PIPE_DIRECTORY"] == mps.pipe_dir
    assert environ["CUDA_MPS_LOG_DIRECTORY"] == mps.log_dir
    assert environ["CUDA_VISIBLE_DEVICES"] == GPU


def test_directories_made_by_the_daemon(daemon):
    """Made by the daemon, the pipe dir (0777) holds control (socket 0666), control_privileged
    (socket 0755), control_lock (file 0666) and log (FIFO); the log dir (0700) its two logs."""
    mps, _ = daemon
    assert mode(mps.pipe_dir) == ("dir", 0o777)
    assert {name: mode(os.path.join(mps.pipe_dir, name)) for name in os.listdir(mps.pipe_dir)} == {
        "control": ("socket", 0o666),
        "control_privileged": ("socket", 0o755),
        "control_lock": ("file", 0o666),
        "log": ("fifo", 0o777),
    }
    assert mode(mps.log_dir) == ("dir", 0o700)
    assert sorted(os.listdir(mps.log_dir)) == ["control.log", "server.log"]


def test_existing_directories_keep_their_mode(mps):
    """Directories that exist already (CardDaemon.start makes them 0755) keep their mode."""
    for directory in (mps.pipe_dir, mps.log_dir):
        os.mkdir(directory, 0o755)
    mps.start()
    assert mode(mps.pipe_dir) == mode(mps.log_dir) == ("dir", 0o755)


def test_control_log_lines(daemon):
    """control.log lines are `[date time.ms Control <pid, width 5>] text`: the start, then
    `Cmd:<line>` and the answer for each command (what operators and e2e tests read)."""
    mps, proc = daemon
    assert mps.ask("set_default_device_pinned_mem_limit 0 15360M") == ""
    assert mps.ask("get_default_device_pinned_mem_limit 0") == "15G\n"
    lines = mps.log().splitlines()
    matches = [LOG_LINE.fullmatch(line) for line in lines]
    assert all(matches), lines
    assert {m.group(1) for m in matches} == {f"{proc.pid:5d}"}
    texts = [m.group(2) for m in matches]
    assert texts[:2] == [
        f"Starting control daemon using socket {mps.pipe_dir}/control",
        f"To connect CUDA applications to this daemon, set env "
        f"CUDA_MPS_PIPE_DIRECTORY={mps.pipe_dir}",
    ]
    commands = [t for t in texts if t not in ("Accepting connection...", "NEW UI", "UI closed")]
    assert commands[2:] == [
        "Cmd:set_default_device_pinned_mem_limit 0 15360M",
        "Cmd:get_default_device_pinned_mem_limit 0",
        "15G",
    ]


def test_second_daemon_is_refused(daemon):
    """-d or -f where a daemon runs: "An instance of this daemon is already running" on
    stdout, exit 1, and the first daemon goes on."""
    mps, proc = daemon
    for flag in ("-d", "-f"):
        done = mps.run(flag)
        assert (done.returncode, done.stdout.strip(), done.stderr) == (1, ALREADY_RUNNING, "")
    assert mps.daemon().pid == proc.pid and mps.ask("get_server_list") == ""


def test_unusable_pipe_directory_fails_the_start(mps):
    """A pipe directory that cannot be made: "Cannot access CUDA_MPS_PIPE_DIRECTORY=<dir>"
    on stdout, exit 1, no daemon."""
    blocker = os.path.join(mps.root, "file")
    open(blocker, "w").close()
    mps.env["CUDA_MPS_PIPE_DIRECTORY"] = mps.pipe_dir = os.path.join(blocker, "pipe")
    done = mps.run("-d")
    assert (done.returncode, done.stderr) == (1, "")
    assert done.stdout.strip() == f"Cannot access CUDA_MPS_PIPE_DIRECTORY={mps.pipe_dir}"
    assert processes_under(mps.root) == []


def test_unusable_log_directory_does_not_stop_the_start(mps):
    """A log directory that cannot be made: a warning on stdout, exit 0, a daemon without logs."""
    blocker = os.path.join(mps.root, "file")
    open(blocker, "w").close()
    mps.env["CUDA_MPS_LOG_DIRECTORY"] = log_dir = os.path.join(blocker, "log")
    done = mps.run("-d")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.strip() == (
        f"Warning: Failed writing log files to directory [{log_dir}]. No logs will be available."
    )
    assert mps.ask("get_default_active_thread_percentage") == "100.0\n"
    assert sorted(os.listdir(mps.pipe_dir)) == ["control", "control_lock", "control_privileged"]


def test_foreground_logs_to_stdout_and_dies_of_sigterm(mps):
    """-f stays in the foreground, writes the log lines to stdout (no control.log) and is
    killed by SIGTERM, leaving its sockets."""
    mps.foreground = subprocess.Popen(
        [mps.binary, "-f"], env=mps.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_until(lambda: mps.client("get_server_list").returncode == 0, what="the daemon")
    assert mps.daemon().pid == mps.foreground.pid  # no fork
    mps.foreground.send_signal(signal.SIGTERM)
    assert mps.foreground.wait(5) == -signal.SIGTERM
    out, err = mps.foreground.communicate()
    assert err == ""
    assert [LOG_LINE.fullmatch(line).group(2) for line in out.splitlines()][0] == (
        f"Starting control daemon using socket {mps.pipe_dir}/control"
    )
    assert os.listdir(mps.log_dir) == []
    assert {"control", "control_privileged"} <= set(os.listdir(mps.pipe_dir))
    assert NO_DAEMON in mps.client("get_server_list").stderr


def test_killed_daemon_leaves_stale_sockets_that_a_new_start_replaces(daemon):
    """A killed daemon leaves its sockets (clients then find no daemon); -d starts anew there."""
    mps, proc = daemon
    proc.kill()
    wait_gone(proc)
    assert mode(os.path.join(mps.pipe_dir, "control"))[0] == "socket"
    done = mps.client("get_server_list")
    assert (done.returncode, done.stdout, done.stderr.strip()) == (1, "", NO_DAEMON)
    assert mps.start().pid != proc.pid
    assert mps.ask("get_server_list") == ""


def test_help_and_other_arguments(daemon):
    """-h prints help on stdout and exits 0; any other arguments are ignored (a client)."""
    mps, _ = daemon
    done = mps.run("-h")
    assert (done.returncode, done.stderr) == (0, "") and "CUDA MPS Control" in done.stdout
    for args in (["-x"], ["quit"], ["-d", "-f"]):
        done = mps.run(*args, stdin="get_default_active_thread_percentage\n")
        assert (done.returncode, done.stdout, done.stderr) == (0, "100.0\n", "")


# The client: commands and answers


def test_no_daemon_is_a_non_zero_exit(mps):
    """Any command without a daemon: "Cannot find MPS control daemon process" on stderr,
    exit 1 (what mps reads as DOWN)."""
    done = mps.client("get_server_list")
    assert (done.returncode, done.stdout, done.stderr.strip()) == (1, "", NO_DAEMON)


def test_server_list_is_empty_without_servers(daemon):
    """get_server_list answers nothing when no server runs (a health check's first question)."""
    mps, _ = daemon
    assert mps.ask("get_server_list") == ""


def test_unknown_command_is_answered_with_exit_status_0(daemon):
    """An unknown command (case matters, a blank line is one) answers `Unknown command "<name>"`
    and the client still exits 0."""
    mps, _ = daemon
    assert mps.ask("bogus_cmd") == 'Unknown command "bogus_cmd"\n'
    assert mps.ask("GET_SERVER_LIST") == 'Unknown command "GET_SERVER_LIST"\n'
    assert mps.ask("") == 'Unknown command ""\n'


def test_get_server_status_is_unknown_to_driver_535(daemon):
    """get_server_status is not a command of driver 535 (the stand-in models a newer driver
    that has it; CardDaemon.probe handles both)."""
    mps, _ = daemon
    expected = 'Unknown command "get_server_status"' if mps.is_real else "Server 12345 not found"
    assert mps.ask("get_server_status 12345") == expected + "\n"


def test_unknown_server_is_not_found_with_exit_status_0(daemon):
    """get_client_list of a PID that is no server answers "Server <PID> not found" (no PID: 0)."""
    mps, _ = daemon
    assert mps.ask("get_client_list 12345") == "Server 12345 not found\n"
    assert mps.ask("get_client_list") == "Server 0 not found\n"


def test_start_server_needs_a_uid(daemon):
    """start_server without `-uid <UID>` answers that a UID is required."""
    mps, _ = daemon
    assert mps.ask("start_server 0") == "A user id (UID) is required to start a new server\n"


def test_thread_percentage_set_answers_the_new_value(daemon):
    """set_default_active_thread_percentage answers the value now in force (`%.1f`, strtod:
    1e1 is 10), and get reads it; 100.0 until set."""
    mps, _ = daemon
    assert mps.ask("get_default_active_thread_percentage") == "100.0\n"
    for value, shown in [("25", "25.0"), ("12.5", "12.5"), ("33.333", "33.3"), ("1e1", "10.0")]:
        assert mps.ask(f"set_default_active_thread_percentage {value}") == shown + "\n"
        assert mps.ask("get_default_active_thread_percentage") == shown + "\n"


@pytest.mark.parametrize("value", ["250", "0", "-5", "abc", "nan", "100.06", ""])
def test_invalid_thread_percentage_answers_the_kept_value(daemon, value):
    """A percentage outside (0, 100] is not taken: the answer is the old value, exit 0, and only
    control.log says it was invalid."""
    mps, _ = daemon
    assert mps.ask("set_default_active_thread_percentage 25") == "25.0\n"
    assert mps.ask(f"set_default_active_thread_percentage {value}") == "25.0\n"
    assert mps.ask("get_default_active_thread_percentage") == "25.0\n"
    assert "Invalid percentage, expected between (0.0, 100.0]" in mps.log_texts()


@pytest.mark.parametrize(
    ("value", "shown"),
    [("4096M", "4G"), ("15360M", "15G"), ("1536M", "1G"), ("2047M", "1G"), ("512M", "512M")]
    + [("1024M", "1G"), ("2G", "2G"), ("1048576M", "1024G")],
)
def test_pinned_limit_reads_back_in_whole_gib(daemon, value, shown):
    """set_default_device_pinned_mem_limit answers nothing; get reads the limit back in whole
    GiB (rounded down) from 1 GiB up, else in MiB."""
    mps, _ = daemon
    assert mps.ask(f"set_default_device_pinned_mem_limit 0 {value}") == ""
    assert mps.ask("get_default_device_pinned_mem_limit 0") == shown + "\n"


@pytest.mark.parametrize(
    ("value", "shown"),
    [("4096", "4G"), ("4g", "4G"), ("4K", "4M"), ("4.5G", "4M"), ("abc", ""), ("0M", "")],
)
def test_pinned_limit_values_are_not_checked(daemon, value, shown):
    """The daemon takes any value without an error: leading digits, then G/g for GiB and
    anything else MiB; 0 (or no digits) removes the limit. So only `<int>M` is ever sent."""
    mps, _ = daemon
    assert mps.ask("set_default_device_pinned_mem_limit 0 2G") == ""
    assert mps.ask(f"set_default_device_pinned_mem_limit 0 {value}") == ""
    assert mps.ask("get_default_device_pinned_mem_limit 0") == (shown + "\n" if shown else "")


def test_pinned_limits_are_per_device_ordinal(daemon):
    """Limits are kept per ordinal, unset ones read empty; a UUID is taken without an answer
    (without a GPU the real daemon keeps nothing for it, so gpushare-node sends ordinals)."""
    mps, _ = daemon
    assert mps.ask("get_default_device_pinned_mem_limit 0") == ""
    assert mps.ask("set_default_device_pinned_mem_limit 1 3G") == ""
    assert mps.ask("get_default_device_pinned_mem_limit 1") == "3G\n"
    assert mps.ask("get_default_device_pinned_mem_limit 0") == ""
    assert mps.ask(f"set_default_device_pinned_mem_limit {GPU} 1024M") == ""


def test_several_commands_in_one_run_answer_in_order(daemon):
    """Commands on stdin are answered one after the other on stdout."""
    mps, _ = daemon
    done = mps.client(
        "set_default_active_thread_percentage 40", "bogus", "get_default_active_thread_percentage"
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == '40.0\nUnknown command "bogus"\n40.0\n'


def test_quit_stops_the_daemon_and_forgets_defaults(daemon):
    """quit answers nothing and the daemon exits (its log FIFO gone, its sockets left); the
    client's exit status is the daemon's (0 here; man page: non-zero when servers did not
    exit gracefully); defaults are gone after a new start."""
    mps, proc = daemon
    assert mps.ask("set_default_active_thread_percentage 40") == "40.0\n"
    done = mps.client("quit")
    assert (done.stdout, done.stderr) == ("", "")
    assert done.returncode in (0, 1)
    wait_gone(proc)
    assert mps.log_texts()[-1].startswith("Exit with status ")
    assert sorted(os.listdir(mps.pipe_dir)) == ["control", "control_lock", "control_privileged"]
    done = mps.client("get_server_list")
    assert (done.returncode, done.stderr.strip()) == (1, NO_DAEMON)
    mps.start()
    assert mps.ask("get_default_active_thread_percentage") == "100.0\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_quit_from_another_user_is_refused_with_exit_status_0(daemon):
    """A non-root client may query but its quit is refused ("Not enough privilege ..."), exit
    0, and the daemon goes on."""
    mps, proc = daemon
    os.chmod(mps.root, 0o755)
    done = mps.client("get_default_active_thread_percentage", "quit", user="nobody")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == "100.0\nNot enough privilege to execute quit command\n"
    assert proc.is_running() and mps.ask("get_server_list") == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the binary as another user")
def test_the_daemons_own_user_may_quit_it(mps):
    """A daemon started by a non-root user can be stopped by that user (it owns
    control_privileged): quit answers nothing and the daemon exits."""
    os.chmod(mps.root, 0o777)
    assert mps.run("-d", user="nobody").returncode == 0
    proc = mps.daemon()
    assert proc.username() == "nobody"
    done = mps.client("quit", user="nobody")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    wait_gone(proc)


# Privilege: what decides who may quit, and what a container may be given


def client_view(mps: Mps, privileged: str) -> str:
    """A directory holding a hard link to the daemon's ``control`` and, as ``privileged``
    says, no ``control_privileged``, a stale socket, a plain file or a second hard link
    to ``control`` under that name."""
    view = os.path.join(mps.root, "view")
    os.mkdir(view)
    os.link(os.path.join(mps.pipe_dir, "control"), os.path.join(view, "control"))
    target = os.path.join(view, "control_privileged")
    if privileged == "stale socket":
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stale:
            stale.bind(target)
    elif privileged == "plain file":
        open(target, "w").close()
    elif privileged == "link to control":
        os.link(os.path.join(mps.pipe_dir, "control"), target)
    return view


@pytest.mark.parametrize("privileged", ["missing", "stale socket", "plain file", "link to control"])
def test_root_through_control_may_query_but_not_quit(daemon, privileged):
    """Privilege follows the socket a connection came in on, not the client's user: root
    whose pipe directory offers only the daemon's `control` (no `control_privileged`, or
    one that refuses, or `control` again under that name) is answered, and its quit is
    refused ("Not enough privilege ...", exit 0); the daemon goes on. The client falls
    back to `control` whenever `control_privileged` fails."""
    mps, proc = daemon
    mps.env["CUDA_MPS_PIPE_DIRECTORY"] = client_view(mps, privileged)
    done = mps.client("get_default_active_thread_percentage", "quit", "get_server_list")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"100.0\n{NO_PRIVILEGE}\n"
    assert not gone(proc)


def test_a_start_replaces_both_sockets(daemon):
    """A daemon that starts unlinks `control` and `control_privileged` and binds new ones:
    new files, not the old inodes. A mount over either name in a container's view of the
    pipe directory is detached by that unlink (the kernel drops mounts on a removed
    name), which is why containers get a directory of their own (docs/mps.md)."""
    mps, proc = daemon
    names = ("control", "control_privileged")
    for name in names:  # a second link keeps each old file (its inode is not reused)
        os.link(os.path.join(mps.pipe_dir, name), os.path.join(mps.root, "old-" + name))
    proc.kill()
    wait_gone(proc)
    mps.start()
    for name in names:
        old, new = os.path.join(mps.root, "old-" + name), os.path.join(mps.pipe_dir, name)
        assert mode(new)[0] == "socket" and not os.path.samefile(old, new), name


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a mount namespace")
def test_a_mount_over_control_privileged_is_lost_when_the_daemon_restarts(daemon):
    """The design this rules out: in a mount namespace of its own (a container's), bind the
    `control` socket over `control_privileged`. Root there is refused `quit` (privilege
    follows the socket) until the daemon restarts: its start unlinks `control_privileged`,
    the kernel detaches the mount in every namespace, and root there quits the new daemon."""
    mps, proc = daemon
    go, ready = os.path.join(mps.root, "go"), os.path.join(mps.root, "ready")
    script = (
        'mount --make-rprivate / && mount --bind "$1/control" "$1/control_privileged" && '
        'echo quit | "$2"; touch "$3"; while [ ! -e "$4" ]; do sleep 0.05; done; '
        'echo quit | "$2"'
    )
    inside = subprocess.Popen(
        ["unshare", "--mount", "sh", "-c", script, "sh", mps.pipe_dir, mps.binary, ready, go],
        env=mps.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: os.path.exists(ready), what="the first quit inside")
        assert not gone(proc)  # refused: through the cover it is `control`
        proc.kill()
        wait_gone(proc)
        restarted = mps.start()
        open(go, "w").close()
        out, err = inside.communicate(timeout=20)
    finally:
        if inside.poll() is None:
            inside.kill()
            inside.wait()
    assert (inside.returncode, out, err) == (0, f"{NO_PRIVILEGE}\n", "")
    wait_gone(restarted)  # the second quit went through: the cover was gone


# The mps library driving each binary


def card_daemon(mps: Mps) -> CardDaemon:
    return CardDaemon(GPU, mps.binary, mps.pipe_dir, mps.log_dir, timeout_seconds=10)


def test_card_daemon_starts_adopts_probes_and_stops(mps):
    """CardDaemon starts the daemon, finds its PID, probes it healthy (another CardDaemon on the
    same pipe dir adopts it) and stops it with quit."""
    card = card_daemon(mps)
    card.start()
    pid = card.pid()
    assert pid == mps.daemon().pid
    health = card.probe()
    assert (health.state, health.servers, health.clients) == (HealthState.HEALTHY, 0, 0)
    adopter = card_daemon(mps)
    assert adopter.probe().ok and adopter.pid() == pid
    adopter.stop()
    assert card.pid() is None and card.probe().state is HealthState.DOWN


@pytest.mark.parametrize("mib", [15360, 4096, 1536, 512])
def test_pinned_ceiling_is_set_and_read_back(daemon, mib):
    """ControlClient.set_default_pinned_mem_limit (the supervisor's ceiling) accepts the
    read-back in whole GiB (4096M reads 4G)."""
    mps, _ = daemon
    client = card_daemon(mps).client
    client.set_default_pinned_mem_limit("0", mib)
    assert client.default_pinned_mem_limit_mib("0") == (mib if mib < 1024 else mib // 1024 * 1024)


def test_refused_thread_percentage_is_an_error(daemon):
    """ControlClient.set_default_active_thread_percentage raises when the daemon keeps the old
    value, and reads what it set."""
    mps, _ = daemon
    client = card_daemon(mps).client
    client.set_default_active_thread_percentage(25)
    with pytest.raises(MpsProtocolError, match=r"kept 25\.0"):
        client.set_default_active_thread_percentage(250)
    assert client.default_active_thread_percentage() == 25.0


def test_unknown_command_is_an_error(daemon):
    """ControlClient.command raises MpsUnsupported for `Unknown command` despite exit status 0."""
    mps, _ = daemon
    with pytest.raises(MpsUnsupported, match='Unknown command "bogus_cmd"'):
        card_daemon(mps).client.command("bogus_cmd")


def start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[19])


def test_card_daemon_verifies_the_daemon_by_the_socket_it_holds(mps):
    """CardDaemon.identify names the process holding the listening `control` socket (PID
    and start time, as control.log names it); a process posing with the daemon's argv and
    env but holding no such socket, started first, is not it; nor is anything once the
    daemon is gone."""
    impostor = subprocess.Popen(
        ["nvidia-cuda-mps-control", "-c", "import time; time.sleep(60)", "-d"],
        executable=sys.executable,
        env=mps.env,
    )
    try:
        card = card_daemon(mps)
        card.start()
        # The daemon listens before its first log line is written: wait for the line.
        first = wait_until(lambda: mps.log().splitlines()[:1], what="control.log's first line")
        pid = int(LOG_LINE.fullmatch(first[0]).group(1))
        assert pid != impostor.pid
        assert card.identify() == DaemonIdentity(pid, start_time(pid))
        os.kill(pid, signal.SIGKILL)
        wait_gone(psutil.Process(pid))
        assert card.identify() is None
    finally:
        impostor.kill()
        impostor.wait()


def fake_server_dir(mps: Mps) -> str:
    """A directory first on the daemon's PATH with a `nvidia-cuda-mps-server` that only
    sleeps (NVIDIA's needs a GPU): the real daemon execs it there, as it would the real
    one; the stand-in runs its own, next to it."""
    directory = os.path.join(mps.root, "bin")
    os.mkdir(directory)
    server = os.path.join(directory, "nvidia-cuda-mps-server")
    with open(server, "w") as f:
        f.write("#!/bin/sh\nwhile :; do sleep 1; done\n")
    os.chmod(server, 0o755)
    mps.env["PATH"] = directory + os.pathsep + mps.env.get("PATH", "")
    return server


def test_servers_are_the_daemons_children_running_the_server_binary(mps):
    """CardDaemon.servers names the server the daemon started (its direct child running
    nvidia-cuda-mps-server, found on the daemon's PATH or next to the control binary),
    with its start time; not the same server file run by another process, and nothing
    for a daemon identity that is no longer the process it named."""
    server_file = fake_server_dir(mps)
    if not mps.is_real:
        server_file = os.path.join(os.path.dirname(MPS_STANDIN), "nvidia-cuda-mps-server")
    mps.start()  # with that PATH
    card = card_daemon(mps)
    identity = card.identify()
    assert mps.ask("start_server -uid 0") == ""
    [server] = wait_until(lambda: [int(p) for p in mps.ask("get_server_list").split()])
    other = subprocess.Popen(["/bin/sh", server_file, str(os.getpid())], env=mps.env)
    try:
        wait_until(lambda: server in [c.pid for c in psutil.Process(identity.pid).children()])
        assert card.servers(identity) == {(server, start_time(server))}
        stale = DaemonIdentity(identity.pid, identity.start_ticks + 1)
        assert card.servers(stale) == frozenset()
    finally:
        other.kill()
        other.wait()


def test_published_client_directory_reaches_the_daemon_but_cannot_quit_it(mps):
    """CardDaemon.publish gives the client directory only `control`, the daemon's socket:
    root there is answered and refused `quit`. A restarted daemon makes a new socket; the
    next publish links it in place (the old link reaches nothing)."""
    card = CardDaemon(GPU, mps.binary, mps.pipe_dir, mps.log_dir, 10, mps.root + "/client")
    card.start()
    card.publish()
    assert os.listdir(card.client_dir) == ["control"]
    mps.env["CUDA_MPS_PIPE_DIRECTORY"] = card.client_dir
    assert mps.client("quit").stdout == NO_PRIVILEGE + "\n"
    old = psutil.Process(card.pid())
    old.kill()
    wait_gone(old)
    card.start()
    assert NO_DAEMON in mps.client("get_server_list").stderr  # the old socket: nobody there
    card.publish()
    assert mps.ask("get_default_active_thread_percentage") == "100.0\n"
    assert mps.client("quit").stdout == NO_PRIVILEGE + "\n"
    assert sorted(os.listdir(card.client_dir)) == ["control"]


# A client that connects and sends nothing (NVIDIA's binary only)


def test_a_silent_client_holds_the_real_daemon_and_is_seen_holding_it(daemon):
    """NVIDIA's daemon serves one client at a time and waits, with no time-out, on the one
    it accepted: while a SOCK_SEQPACKET client of `control` sends nothing, every command
    hangs (a probe is HUNG); mps.connections then sees that connection, bound to
    `control`'s own file, the daemon blocked reading it (recvmsg) with nothing unread, held
    by this process; once it closes, the daemon answers again. The stand-in serves each
    client on a thread of its own and never hangs so: this is the real binary's fact."""
    mps, proc = daemon
    if not mps.is_real:
        pytest.skip("the stand-in serves every client on its own thread: no hang to pin")
    card = CardDaemon(GPU, mps.binary, mps.pipe_dir, mps.log_dir, 1.0)
    identity = DaemonIdentity(proc.pid, card.identify().start_ticks)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as silent:
        silent.connect(os.path.join(mps.pipe_dir, "control"))
        assert card.probe().state is HealthState.HUNG

        def blocked():
            seen = card.look(identity, os.getpid())
            return seen if any(c.blocked for c in seen.connections) else None

        look = wait_until(blocked, what="the daemon blocked on its connection")
        assert look.problem is None and not look.stopped
        [connection] = look.connections
        assert connection.blocked == "reading" and connection.unread == 0
        assert [(h.pid, h.ours) for h in connection.holders] == [(os.getpid(), True)]
        assert connection.peer == os.fstat(silent.fileno()).st_ino
    assert wait_until(lambda: card.probe().ok, what="the daemon answering again")
