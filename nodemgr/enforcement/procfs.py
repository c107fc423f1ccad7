"""What the watchdog reads from /proc, and the one way it kills a process.

Every read returns None when the process is gone (or was never there): the
caller treats a vanished process as not running, never as an error. A kill
goes through a pidfd checked against the process's start time, so a PID
reused by an unrelated process between the check and the kill is never hit.

A process is hostile input: it chooses its cgroup names (any byte but NUL
and '/', 0xff included), its environ (up to ARG_MAX, and rewritable in its
own memory) and its command name. Every file is therefore read as bytes, up
to a cap, and parsed here by the pure ``parse_*``/``decode_*`` functions.
What cannot be read as the kernel writes it for an ordinary process (not
UTF-8, larger than its cap, malformed, unreadable for another reason than
the process being gone) raises :class:`ProcfsError` naming the file; nothing
else escapes a read. The caller decides what an unreadable process is (the
watchdog: one it cannot tie to any container, which fails closed).

A read or kill that fails for want of this daemon's own resources (no file
descriptor left: EMFILE, ENFILE; no memory) raises :class:`Exhausted`, a
ProcfsError that says nothing about the process: every caller that refuses an
unreadable process refuses it too, and the watchdog, for which an unreadable
process is one to kill, fails the whole scan instead of judging anyone on it.
"""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass

from hooks.gpuenv import GPU_ENV_NAMES

PROC = "/proc"

# The most each file is read before it is refused as not what the kernel writes.
CGROUP_MAX_BYTES = 256 * 1024  # a line per hierarchy, each path at most PATH_MAX
ENVIRON_MAX_BYTES = 1024 * 1024  # a larger environ is refused, not read whole
STAT_MAX_BYTES = 4096  # 52 numeric fields and a command name of at most 64 bytes
_CHUNK_BYTES = 64 * 1024
_MAX_NUMBER_DIGITS = 20  # a 64-bit unsigned number

_open = open  # the reading seam (tests make a file vanish or fail mid-read)


class ProcfsError(Exception):
    """/proc/PID/<file> is there but cannot be read as what the kernel writes (the message
    names the file and why). The process may still run: it is not "gone"."""


class Exhausted(ProcfsError):
    """This daemon has no file descriptor (or memory) left to read /proc or kill with: the
    failure is ours, not the process's."""


# errno values that mean the daemon itself is out of a resource.
_OWN_LIMITS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


@dataclass(frozen=True)
class Stat:
    """The fields of /proc/PID/stat the watchdog uses."""

    state: str  # R, S, D, Z, T, ... (one ASCII letter)
    parent: int
    start_ticks: int  # clock ticks since boot


# --- the reads -------------------------------------------------------------------------------


def read_cgroups_text(pid: int) -> str | None:
    """/proc/PID/cgroup as text; ProcfsError when it is not UTF-8 or over its cap."""
    data = _read(pid, "cgroup", CGROUP_MAX_BYTES)
    return None if data is None else decode_cgroups(data, f"{PROC}/{pid}/cgroup")


def read_gpu_env(pid: int) -> dict[str, str] | None:
    """The GPU env names (hooks.gpuenv.GPU_ENV_NAMES) of /proc/PID/environ.

    ProcfsError when the environ is larger than ENVIRON_MAX_BYTES: which value
    a name has could then lie past what was read.
    """
    data = _read(pid, "environ", ENVIRON_MAX_BYTES)
    return None if data is None else parse_environ(data)


def read_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat: start time in clock ticks since boot; None for a zombie.

    A zombie has exited and released its GPU memory; only its parent has not
    collected it yet, so it counts as gone.
    """
    stat = read_stat(pid)
    if stat is None or stat.state == "Z":
        return None
    return stat.start_ticks


def read_parent(pid: int) -> int | None:
    """Field 4 of /proc/PID/stat: the parent's PID."""
    stat = read_stat(pid)
    return None if stat is None else stat.parent


def read_stat(pid: int) -> Stat | None:
    data = _read(pid, "stat", STAT_MAX_BYTES)
    return None if data is None else parse_stat(data, f"{PROC}/{pid}/stat")


def in_our_mount_ns(pid: int) -> bool | None:
    """Whether the process shares the node daemon's mount namespace (every container has
    one of its own); None when its namespace cannot be read."""
    try:
        theirs, ours = os.stat(f"{PROC}/{pid}/ns/mnt"), os.stat(f"{PROC}/self/ns/mnt")
    except OSError:
        return None
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def kill(pid: int, start_ticks: int) -> bool:
    """SIGKILL the process if it is still the one that started at ``start_ticks``.

    False when it is gone, is another process now, or its start time cannot be
    read (nothing is killed that could not be checked); Exhausted when this daemon
    has no descriptor left to check and kill with (nothing was killed)."""
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
    """/proc/PID/cgroup as text: strict UTF-8 (a cgroup named with 0xff is refused)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProcfsError(
            f"{where} is not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}: a cgroup "
            "named with it); the process cannot be tied to any container"
        ) from None


def parse_environ(data: bytes) -> dict[str, str]:
    """The GPU env names of an environ block (``NAME=value`` entries, NUL-separated).

    The first entry of a name wins, as getenv() sees it; an entry without '='
    names nothing (getenv() skips it too). A value that is not UTF-8 is kept
    with U+FFFD in place of the bad bytes: never a valid quota value, so the
    quota parsers refuse it.
    """
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
    """/proc/PID/stat's state, parent and start time.

    The command name (field 2) may hold spaces and ')': the fields are split
    after the last ')'.
    """
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
    """/proc/PID/<name>, at most ``limit`` bytes; None when the process is gone."""
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
