"""What the watchdog reads from /proc, and the one way it kills a process.

A read returns None when the process is gone, never an error. A kill goes through a
pidfd checked against the start time, so a reused PID is never hit.

A process chooses its cgroup names (any byte but NUL and '/'), its environ (up to
ARG_MAX, rewritable in its memory) and its command name, so every file is read as bytes
up to a cap and parsed by the pure ``parse_*``/``decode_*`` functions. What is not as
the kernel writes it raises :class:`ProcfsError` naming the file. A failure for want
of this daemon's own descriptors or memory raises :class:`Exhausted`: it says nothing
about the process, so the watchdog fails the whole scan rather than judge anyone on it.
"""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass

from hooks.gpuenv import GPU_ENV_NAMES

PROC = "/proc"

CGROUP_MAX_BYTES = 256 * 1024  # a line per hierarchy, each path at most PATH_MAX
ENVIRON_MAX_BYTES = 1024 * 1024  # a larger environ is refused, not read whole
STAT_MAX_BYTES = 4096  # 52 numeric fields and a command name of at most 64 bytes
_CHUNK_BYTES = 64 * 1024
_MAX_NUMBER_DIGITS = 20  # a 64-bit unsigned number

_open = open  # the reading seam (tests make a file vanish or fail mid-read)


class ProcfsError(Exception):
    """/proc/PID/<file> is there but not as the kernel writes it; the process may still
    run."""


class Exhausted(ProcfsError):
    """The daemon's own descriptors or memory ran out: not the process's failure."""


# errno values that mean the daemon itself is out of a resource.
_OWN_LIMITS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


@dataclass(frozen=True)
class Stat:
    state: str  # R, S, D, Z, T, ... (one ASCII letter)
    parent: int
    start_ticks: int  # clock ticks since boot


# --- the reads -------------------------------------------------------------------------------


def read_cgroups_text(pid: int) -> str | None:
    data = _read(pid, "cgroup", CGROUP_MAX_BYTES)
    return None if data is None else decode_cgroups(data, f"{PROC}/{pid}/cgroup")


def read_gpu_env(pid: int) -> dict[str, str] | None:
    """ProcfsError over ENVIRON_MAX_BYTES: a name's value could lie past what was read."""
    data = _read(pid, "environ", ENVIRON_MAX_BYTES)
    return None if data is None else parse_environ(data)


def read_start_ticks(pid: int) -> int | None:
    """None for a zombie: it has released its GPU memory, so it counts as gone."""
    stat = read_stat(pid)
    if stat is None or stat.state == "Z":
        return None
    return stat.start_ticks


def read_parent(pid: int) -> int | None:
    stat = read_stat(pid)
    return None if stat is None else stat.parent


def read_stat(pid: int) -> Stat | None:
    data = _read(pid, "stat", STAT_MAX_BYTES)
    return None if data is None else parse_stat(data, f"{PROC}/{pid}/stat")


def in_our_mount_ns(pid: int) -> bool | None:
    """Every container has a mount namespace of its own; None when unreadable."""
    try:
        theirs, ours = os.stat(f"{PROC}/{pid}/ns/mnt"), os.stat(f"{PROC}/self/ns/mnt")
    except OSError:
        return None
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def kill(pid: int, start_ticks: int) -> bool:
    """SIGKILL the process if it is still the one that started at ``start_ticks``; False
    when it is gone, another process now or unreadable (nothing unchecked is killed)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError as e:
        if e.errno in _OWN_LIMITS:
            raise Exhausted(f"cannot open a pidfd for process {pid}: {e.strerror}") from None
        raise
    try:
        if read_start_ticks(pid) != start_ticks:
            return False
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except Exhausted:
        raise
    except (ProcessLookupError, ProcfsError):
        return False
    finally:
        os.close(pidfd)


# --- the parsers (pure: bytes in, value or ProcfsError out) -----------------------------------


def decode_cgroups(data: bytes, where: str = "/proc/PID/cgroup") -> str:
    """Strict UTF-8: a cgroup named with 0xff is refused."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProcfsError(
            f"{where} is not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}: a cgroup "
            "named with it); the process cannot be tied to any container"
        ) from None


def parse_environ(data: bytes) -> dict[str, str]:
    """The GPU env names of an environ block, as getenv() sees them (first entry wins,
    one without '=' names nothing). A non-UTF-8 value keeps U+FFFD for the bad bytes:
    never a valid quota value."""
    env: dict[str, str] = {}
    for entry in data.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if not sep or not name.isascii():
            continue
        text = name.decode("ascii")
        if text in GPU_ENV_NAMES and text not in env:
            env[text] = value.decode("utf-8", "replace")
    return env


def parse_stat(data: bytes, where: str = "/proc/PID/stat") -> Stat:
    """Split after the last ')': the command name may hold spaces and ')'."""
    close = data.rfind(b")")
    fields = data[close + 2 :].split() if close >= 0 else []
    if len(fields) < 20:
        raise ProcfsError(f"{where} has {len(fields) + 2} fields, not the kernel's 52")
    state, parent, start = fields[0], fields[1], fields[19]
    if len(state) != 1 or not state.isalpha() or not state.isascii():
        raise ProcfsError(f"{where}: state {state[:16]!r} is not one letter")
    return Stat(state.decode("ascii"), _number(parent, where), _number(start, where))


def _number(field: bytes, where: str) -> int:
    # bytes.isdigit() is ASCII digits only; int() would also take '_', '+' and spaces.
    if not field.isdigit() or len(field) > _MAX_NUMBER_DIGITS:
        raise ProcfsError(f"{where}: {field[:24]!r} is not a number")
    return int(field)


def _read(pid: int, name: str, limit: int) -> bytes | None:
    path = f"{PROC}/{pid}/{name}"
    chunks: list[bytes] = []
    size = 0
    try:
        with _open(path, "rb", buffering=0) as f:
            while True:
                chunk = f.read(min(_CHUNK_BYTES, limit + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise ProcfsError(f"{path} is larger than {limit} bytes: not read whole")
    except (FileNotFoundError, ProcessLookupError):
        return None  # gone, also when it exits in the middle of the read
    except OSError as e:
        if e.errno in _OWN_LIMITS:
            raise Exhausted(f"{path} cannot be read: {e.strerror}") from None
        raise ProcfsError(f"{path} cannot be read: {e.strerror or e}") from None
    return b"".join(chunks)
