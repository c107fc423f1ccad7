"""What the watchdog reads from /proc, and the one way it kills a process.

Every read returns None when the process is gone (or was never there): the
caller treats a vanished process as not running, never as an error. A kill
goes through a pidfd checked against the process's start time, so a PID
reused by an unrelated process between the check and the kill is never hit.
"""

from __future__ import annotations

import os
import signal

from hooks.gpuenv import GPU_ENV_NAMES

PROC = "/proc"


def read_cgroups_text(pid: int) -> str | None:
    try:
        with open(f"{PROC}/{pid}/cgroup", encoding="utf-8") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None


def read_gpu_env(pid: int) -> dict[str, str] | None:
    """The GPU env names (hooks.gpuenv.GPU_ENV_NAMES) of /proc/PID/environ."""
    try:
        with open(f"{PROC}/{pid}/environ", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    env = {}
    for entry in data.split(b"\0"):
        name, _, value = entry.decode("utf-8", "replace").partition("=")
        if name in GPU_ENV_NAMES and name not in env:  # getenv() takes the first
            env[name] = value
    return env


def read_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat: start time in clock ticks since boot; None for a zombie.

    A zombie has exited and released its GPU memory; only its parent has not
    collected it yet, so it counts as gone.
    """
    fields = _stat_fields(pid)
    if fields is None or fields[0] == b"Z":
        return None
    return int(fields[19])


def read_parent(pid: int) -> int | None:
    """Field 4 of /proc/PID/stat: the parent's PID."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def kill(pid: int, start_ticks: int) -> bool:
    """SIGKILL the process if it is still the one that started at ``start_ticks``."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if read_start_ticks(pid) != start_ticks:
            return False
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)


def _stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat from field 3 (state) on."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and ')': split after the last ')'.
    return data[data.rfind(b")") + 2 :].split()
