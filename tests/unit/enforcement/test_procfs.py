"""Pins nodemgr.enforcement.procfs on real processes: the reads see this process and its children, a
zombie or a missing pid reads as gone (None), /proc/PID/stat is split after the last ')' so odd
command names do not shift fields, only GPU env names are read (the first of a repeated name, as
getenv sees it), and kill() stops a process only when its start time still matches. Hostile
contents (a real cgroup named with 0xff, an environ over 1 MiB, a GPU env value that is not
UTF-8) raise procfs.ProcfsError or read as replaced text, never a decode error. A read or kill
with no descriptor left raises procfs.Exhausted: the daemon's failure, not the process's."""

import contextlib
import os
import re
import subprocess
import sys
import time

import pytest

from nodemgr.enforcement import procfs
from standins.fdexhaust import no_descriptors_left

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


# --- hostile /proc contents (issue 14, item 3) ---------------------------------------------

CGROUP_ROOT = "/sys/fs/cgroup"
# Where a test cgroup may be made: cgroup v2 at the root, or a v1 hierarchy / the v2 mount.
CGROUP_PLACES = ("", "unified", "pids", "freezer", "systemd")


def _cgroup_parent() -> str | None:
    for place in CGROUP_PLACES:
        path = os.path.join(CGROUP_ROOT, place)
        if os.path.exists(os.path.join(path, "cgroup.procs")) and os.access(path, os.W_OK):
            return path
    return None


def raised_by(function, *args):
    """What ``function(*args)`` raised (fails the test when it returned instead)."""
    try:
        returned = function(*args)
    except Exception as e:
        return e
    pytest.fail(f"returned {returned!r} instead of raising")


@contextlib.contextmanager
def process_in_cgroup_named(name: bytes, argv=("sleep", "1000")):
    """A real child process moved into a real cgroup named ``name`` (bytes: any byte the
    kernel allows, 0xff included); skips when cgroupfs here cannot make one."""
    parent = _cgroup_parent()
    if parent is None:
        pytest.skip("no writable cgroup hierarchy here (needs root and cgroupfs)")
    path = os.path.join(os.fsencode(parent), name + b"-%d" % os.getpid())
    try:
        os.mkdir(path)
    except OSError as e:
        pytest.skip(f"the kernel refuses a cgroup named {name!r}: {e}")
    child = subprocess.Popen(list(argv))
    try:
        with open(os.path.join(path, b"cgroup.procs"), "w") as f:
            f.write(str(child.pid))
        yield child
    finally:
        child.kill()
        child.wait()
        deadline = time.monotonic() + 5
        while True:
            try:
                os.rmdir(path)
                break
            except OSError:  # EBUSY until the kernel has moved the dead child out
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)


def test_a_cgroup_named_with_0xff_is_a_procfs_error_not_a_decode_crash():
    """A container may name a cgroup with any byte: /proc/PID/cgroup is then not UTF-8.
    Reading it raises the module's own error (naming the file), nothing else."""
    with process_in_cgroup_named(b"gs-\xff") as child:
        with open(f"/proc/{child.pid}/cgroup", "rb") as f:
            assert b"\xff" in f.read()  # really there, as the kernel shows it
        raised = raised_by(procfs.read_cgroups_text, child.pid)
        assert isinstance(raised, procfs.ProcfsError), repr(raised)
        assert re.search(rf"/proc/{child.pid}/cgroup.*UTF-8", str(raised)), str(raised)
        # The other reads of the same process still work.
        assert procfs.read_parent(child.pid) == os.getpid()
        assert procfs.read_start_ticks(child.pid) is not None


def test_an_environ_over_the_cap_is_refused_not_read_whole(children):
    """/proc/PID/environ is read up to ENVIRON_MAX_BYTES (1 MiB); a larger one is a
    ProcfsError (the watchdog judges that process's quota env unreadable)."""
    padding = {f"PAD{i}": "x" * 100_000 for i in range(12)}  # ~1.2 MB, under ARG_MAX
    child = children(SLEEP, env={"PATH": "/usr/bin:/bin", **padding})
    wait_for_environ(child.pid)
    raised = raised_by(procfs.read_gpu_env, child.pid)
    assert isinstance(raised, procfs.ProcfsError), repr(raised)
    assert re.search(r"environ.*larger than 1048576 bytes", str(raised)), str(raised)
    assert procfs.ENVIRON_MAX_BYTES == 1024 * 1024


def test_an_environ_value_that_is_not_utf8_is_read_without_raising(children):
    """A GPU env value with a byte that is not UTF-8 is read (replaced, so that the quota
    parsers refuse it), never a decode error."""
    script = (
        "import os, sys\n"
        "os.execve(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)'],"
        " {b'CUDA_MPS_ACTIVE_THREAD_PERCENTAGE': b'3\\xff0', b'PATH': b'/bin'})\n"
    )
    child = children([sys.executable, "-c", script])
    wait_until(lambda: procfs.read_gpu_env(child.pid))
    assert procfs.read_gpu_env(child.pid) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "3\ufffd0"}


# --- out of descriptors: the daemon's problem, not the process's --------------------------------


def test_a_read_without_a_descriptor_left_is_exhausted_not_a_process_fault(children):
    """With no file descriptor left (EMFILE), reading a live process raises Exhausted (a
    ProcfsError saying the daemon, not the process, failed), never None or plain ProcfsError
    from which the process would be judged."""
    child = children()
    with no_descriptors_left():
        with pytest.raises(procfs.Exhausted, match="Too many open files"):
            procfs.read_cgroups_text(child.pid)
        with pytest.raises(procfs.Exhausted):
            procfs.read_start_ticks(child.pid)
    assert procfs.read_start_ticks(child.pid) is not None


def test_a_kill_without_a_descriptor_left_is_exhausted_and_kills_nothing(children):
    """kill() with no descriptor for the pidfd raises Exhausted (not False: the caller must
    know it could not act) and the process runs on."""
    child = children()
    start = procfs.read_start_ticks(child.pid)
    with no_descriptors_left():
        with pytest.raises(procfs.Exhausted, match="pidfd"):
            procfs.kill(child.pid, start)
    assert child.poll() is None
    with no_descriptors_left(spare=1):  # the pidfd opens; the start time cannot be read
        with pytest.raises(procfs.Exhausted):
            procfs.kill(child.pid, start)
    assert child.poll() is None
    assert procfs.kill(child.pid, start) is True
