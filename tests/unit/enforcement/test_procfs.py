"""Pins nodemgr.enforcement.procfs on real processes: the reads see this process and its children, a
zombie or a missing pid reads as gone (None), /proc/PID/stat is split after the last ')' so odd
command names do not shift fields, only GPU env names are read (the first of a repeated name, as
getenv sees it), and kill() stops a process only when its start time still matches."""

import os
import subprocess
import sys
import time

import pytest

from nodemgr.enforcement import procfs

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def children():
    started = []

    def start(argv=SLEEP, **kwargs):
        child = subprocess.Popen(argv, **kwargs)
        started.append(child)
        return child

    yield start
    for child in started:
        if child.poll() is None:
            child.kill()
        child.wait()


def missing_pid():
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1  # above pid_max: never a process


def stat_state(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return data[data.rfind(b")") + 2 :].split()[0]


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def wait_for_environ(pid):
    """The kernel fills /proc/PID/environ a moment after exec() closes Popen's pipe."""

    def filled():
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read() != b""

    wait_until(filled)


def uptime_ticks():
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK")


def test_reads_of_this_process():
    pid = os.getpid()
    with open("/proc/self/cgroup") as f:
        assert procfs.read_cgroups_text(pid) == f.read()
    assert procfs.read_parent(pid) == os.getppid()
    ticks = procfs.read_start_ticks(pid)
    assert isinstance(ticks, int) and 0 <= ticks <= uptime_ticks() + 1


def test_reads_of_a_child(children):
    child = children()
    assert procfs.read_parent(child.pid) == os.getpid()
    assert procfs.read_cgroups_text(child.pid) == procfs.read_cgroups_text(os.getpid())
    ticks = procfs.read_start_ticks(child.pid)
    assert procfs.read_start_ticks(os.getpid()) <= ticks <= uptime_ticks() + 1
    assert procfs.read_start_ticks(child.pid) == ticks  # stable while it runs


def test_odd_command_name_does_not_shift_the_stat_fields(children, tmp_path):
    odd = str(tmp_path / "a) b) c")
    os.symlink(sys.executable, odd)
    child = children([odd, *SLEEP[1:]])

    def comm():
        with open(f"/proc/{child.pid}/comm") as f:
            return f.read()

    wait_until(lambda: ")" in comm())  # the kernel renames it a moment after Popen returns
    assert procfs.read_parent(child.pid) == os.getpid()
    assert procfs.read_start_ticks(child.pid) >= procfs.read_start_ticks(os.getpid())


def test_missing_pid_reads_as_gone():
    pid = missing_pid()
    assert procfs.read_cgroups_text(pid) is None
    assert procfs.read_gpu_env(pid) is None
    assert procfs.read_start_ticks(pid) is None
    assert procfs.read_parent(pid) is None
    assert procfs.kill(pid, 1) is False


def test_zombie_has_no_start_ticks_and_is_not_killed(children):
    child = children([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    ticks_while_alive = procfs.read_start_ticks(child.pid)
    assert ticks_while_alive is not None
    child.stdin.close()  # it exits now
    wait_until(lambda: stat_state(child.pid) == b"Z")  # exited, not waited for
    assert procfs.read_start_ticks(child.pid) is None
    assert procfs.kill(child.pid, ticks_while_alive) is False
    assert stat_state(child.pid) == b"Z"  # not collected by anyone but us
    child.wait()


ECHO = [sys.executable, "-c", "import sys\nfor line in sys.stdin: print(line, end='', flush=True)"]


def test_kill_with_wrong_start_ticks_leaves_the_process_running(children):
    """A start time that does not match (a reused PID) sends nothing: the process still
    answers afterwards (a SIGKILL sent would end it before it could read again)."""
    child = children(ECHO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ticks = procfs.read_start_ticks(child.pid)
    assert procfs.kill(child.pid, ticks + 1) is False
    assert procfs.kill(child.pid, ticks - 1) is False
    child.stdin.write("still there?\n")
    child.stdin.flush()
    assert child.stdout.readline() == "still there?\n"
    assert child.poll() is None


def test_kill_with_the_right_start_ticks_sigkills(children):
    child = children()
    assert procfs.kill(child.pid, procfs.read_start_ticks(child.pid)) is True
    assert child.wait(timeout=5) == -9


def test_read_gpu_env_returns_only_gpu_names(children):
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "NVIDIA_VISIBLE_DEVICES": "GPU-x",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M",
        "GPUSHARE_ALLOCATION_ID": "ga-1",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "",
        "SECRET_TOKEN": "hunter2",
        "NVIDIA_DRIVER_CAPABILITIES": "compute",
    }
    child = children(SLEEP, env=env)
    wait_for_environ(child.pid)
    assert procfs.read_gpu_env(child.pid) == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-x",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M",
        "GPUSHARE_ALLOCATION_ID": "ga-1",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "",
    }


def test_read_gpu_env_of_a_process_without_gpu_env_is_empty(children):
    child = children(SLEEP, env={"PATH": "/usr/bin:/bin"})
    wait_for_environ(child.pid)
    assert procfs.read_gpu_env(child.pid) == {}


def test_read_gpu_env_takes_the_first_of_a_repeated_name(children):
    # execve() with a raw envp can repeat a name; getenv() returns the first.
    script = (
        "import ctypes, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "exe = sys.executable.encode()\n"
        "argv = (ctypes.c_char_p * 4)(exe, b'-c', b'import time; time.sleep(60)', None)\n"
        "envp = (ctypes.c_char_p * 3)(b'NVIDIA_VISIBLE_DEVICES=GPU-first',"
        " b'NVIDIA_VISIBLE_DEVICES=all', None)\n"
        "libc.execve(exe, argv, envp)\n"
        "sys.exit(3)\n"
    )
    child = children([sys.executable, "-c", script], env={"PATH": "/usr/bin:/bin"})
    wait_until(lambda: child.poll() is not None or procfs.read_gpu_env(child.pid))
    assert child.poll() is None
    assert procfs.read_gpu_env(child.pid) == {"NVIDIA_VISIBLE_DEVICES": "GPU-first"}
