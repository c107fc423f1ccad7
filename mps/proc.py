"""Finding a card's control daemon and its MPS servers in /proc (the judging is mps.identity).

Every file is read as bytes up to a cap. A process that vanishes while read, or whose
file is unreadable, too large or malformed, is neither the daemon nor a server (fail
closed) and the search goes on. Nothing here raises because of what a process did: a
hostile tenant must not stop the watchdog's scan.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection, Iterator
from typing import BinaryIO

from mps.identity import (
    Candidate,
    Child,
    DaemonIdentity,
    Executable,
    FileId,
    Stat,
    choose_daemon,
    choose_servers,
    environ_path,
    is_script,
    listed_inodes,
    listening_inodes,
    parse_children,
    parse_stat,
    parse_uids,
    runs,
    search_path,
    socket_inode,
)

PROC = "/proc"
SERVER_NAME = "nvidia-cuda-mps-server"
STAT_MAX_BYTES = 4096  # 52 numeric fields and a name of at most 64 bytes
STATUS_MAX_BYTES = 64 * 1024
ENVIRON_MAX_BYTES = 1024 * 1024
CHILDREN_MAX_BYTES = 1024 * 1024
# A /proc/net/unix line holds a path of at most 108 bytes.
NET_UNIX_LINE_MAX_BYTES = 512
MAX_FDS = 65536  # a process holding more open files is not looked through: not the daemon
_CHUNK_BYTES = 64 * 1024

_open = open  # the reading seam (tests make a file vanish, grow or fail mid-read)


def find_daemon(
    pipe_dir: str,
    binary: str,
    previous: DaemonIdentity | None = None,
    namespaces: Collection[FileId] = (),
) -> DaemonIdentity | None:
    """The control daemon serving ``pipe_dir``, verified; None when no single process
    passes. ``namespaces``: mount namespaces trusted besides ours (the card's)."""
    program = executable(binary)
    listening = listening_at(os.path.join(pipe_dir, "control"))
    our_ns = mount_ns("self")
    if program is None or not listening or our_ns is None:
        return None
    trusted = {our_ns, *namespaces}
    uid = os.geteuid()
    if previous is not None:
        # Checking it alone spares a walk of the process table at every health check.
        again = _candidate(previous.pid, program, listening, trusted, uid)
        if again is not None and again.start_ticks == previous.start_ticks:
            return previous
    candidates = []
    for pid in pids():
        candidate = _candidate(pid, program, listening, trusted, uid)
        if candidate is not None:
            candidates.append(candidate)
    return choose_daemon(candidates, previous)


def _candidate(
    pid: int, program: Executable, listening: set[int], trusted: set[FileId], uid: int
) -> Candidate | None:
    """``pid`` as a candidate if it passes every test, cheapest first."""
    exe, link = exe_of(pid)
    if not program.script and not runs(exe, link, (), program):
        return None  # a binary: exe alone decides
    if mount_ns(pid) not in trusted:
        return None
    uids = uids_of(pid)
    if uids is None or any(u != uid for u in uids):
        return None
    before = stat_of(pid)
    held = held_by(pid, files=program.script)
    if before is None or held is None:
        return None
    sockets, files = held
    if not sockets & listening or not runs(exe, link, files, program):
        return None
    if stat_of(pid) != before or before.state == "Z":
        return None  # exited (or its PID reused) while it was read
    return Candidate(pid, before.parent, before.start_ticks)


def find_servers(daemon: DaemonIdentity, binary: str) -> frozenset[tuple[int, int]]:
    """(PID, start ticks) of ``daemon``'s MPS servers; empty once it is gone."""
    control = executable(binary)
    daemon_ns = mount_ns(daemon.pid)
    if control is None or daemon_ns is None or not _still(daemon):
        return frozenset()
    programs = server_programs(daemon.pid, control)
    children = []
    for pid in children_of(daemon.pid) or ():
        child = _child(pid, programs, daemon_ns)
        if child is not None:
            children.append(child)
    if not _still(daemon):
        return frozenset()  # gone while its children were read: they may be another's
    return choose_servers(daemon, children)


def _still(daemon: DaemonIdentity) -> bool:
    stat = stat_of(daemon.pid)
    return stat is not None and stat.start_ticks == daemon.start_ticks and stat.state != "Z"


def _child(pid: int, programs: list[Executable], daemon_ns: FileId) -> Child | None:
    before = stat_of(pid)
    if before is None:
        return None
    exe, link = exe_of(pid)
    files: set[FileId] = set()
    if any(p.script for p in programs):
        held = held_by(pid, files=True)
        files = held[1] if held is not None else set()
    runs_server = any(runs(exe, link, files, program) for program in programs)
    in_daemon_ns = mount_ns(pid) == daemon_ns
    if stat_of(pid) != before:
        return None  # exited (or its PID reused) while it was read
    return Child(
        pid, before.parent, before.start_ticks, before.state == "Z", runs_server, in_daemon_ns
    )


def server_programs(daemon_pid: int, control: Executable) -> list[Executable]:
    """The server binaries the daemon may start: the first on its PATH (its execlp) and
    the one next to the control binary (where NVIDIA's installer puts it)."""
    paths = []
    environ = read_file(f"{PROC}/{daemon_pid}/environ", ENVIRON_MAX_BYTES)
    if environ is not None:
        for path in search_path(environ_path(environ), SERVER_NAME):
            if os.path.isfile(path) and os.access(path, os.X_OK):
                paths.append(path)
                break
    paths.append(os.path.join(os.path.dirname(control.path), SERVER_NAME))
    return [p for p in map(executable, paths) if p is not None]


# --- the reads -------------------------------------------------------------------------------


def executable(binary: str, search: str | None = None) -> Executable | None:
    """The program file ``binary`` names (a path, or a name looked up in PATH)."""
    path = binary if "/" in binary else shutil.which(binary, path=search)
    if path is None:
        return None
    real = os.path.realpath(path)
    identity = file_id(real)
    try:
        with _open(real, "rb") as f:
            head = f.read(2)
    except OSError:
        return None
    return None if identity is None else Executable(real, identity, is_script(head))


def listening_at(path: str) -> set[int] | None:
    """Inodes of the sockets our /proc/net/unix lists as listening at ``path``."""
    try:
        with _open(f"{PROC}/net/unix", "rb") as f:
            return listening_inodes(_lines(f), os.fsencode(path))
    except OSError:
        return None


def sockets_listed(pid: int) -> set[int]:
    """Inodes of the sockets /proc/PID/net/unix lists; empty when unreadable."""
    try:
        with _open(f"{PROC}/{pid}/net/unix", "rb") as f:
            return listed_inodes(_lines(f))
    except OSError:
        return set()


def _lines(f: BinaryIO) -> Iterator[bytes]:
    """The lines of ``f``, each read up to its cap; an overlong one is skipped whole."""
    while line := f.readline(NET_UNIX_LINE_MAX_BYTES + 1):
        if len(line) <= NET_UNIX_LINE_MAX_BYTES or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = f.readline(NET_UNIX_LINE_MAX_BYTES + 1)


def pids() -> list[int]:
    try:
        names = os.listdir(PROC)
    except OSError:
        return []
    return [int(name) for name in names if name.isascii() and name.isdigit()]


def stat_of(pid: int) -> Stat | None:
    data = read_file(f"{PROC}/{pid}/stat", STAT_MAX_BYTES)
    return None if data is None else parse_stat(data)


def uids_of(pid: int) -> tuple[int, ...] | None:
    data = read_file(f"{PROC}/{pid}/status", STATUS_MAX_BYTES)
    return None if data is None else parse_uids(data)


def mount_ns(pid: int | str) -> FileId | None:
    """The mount namespace of ``pid`` ("self": ours) as a file identity."""
    return file_id(f"{PROC}/{pid}/ns/mnt")


def exe_of(pid: int) -> tuple[FileId | None, str | None]:
    path = f"{PROC}/{pid}/exe"
    try:
        link: str | None = os.readlink(path)
    except OSError:
        link = None
    return file_id(path), link


def held_by(pid: int, files: bool) -> tuple[set[int], set[FileId]] | None:
    """The socket inodes and, with ``files``, the files the process holds open; None
    when its fd directory is unreadable or holds more than MAX_FDS."""
    directory = f"{PROC}/{pid}/fd"
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    if len(names) > MAX_FDS:
        return None
    sockets: set[int] = set()
    held: set[FileId] = set()
    for name in names:
        try:
            link = os.readlink(f"{directory}/{name}")
        except OSError:
            continue  # closed meanwhile
        inode = socket_inode(link)
        if inode is not None:
            sockets.add(inode)
        elif files:
            identity = file_id(f"{directory}/{name}")
            if identity is not None:
                held.add(identity)
    return sockets, held


def children_of(pid: int) -> list[int] | None:
    """The direct children of ``pid`` (each thread's children file, or a scan where the
    kernel has none); None when unreadable."""
    if not os.path.exists(f"{PROC}/{pid}/task/{pid}/children"):
        return _children_by_scan(pid) if os.path.isdir(f"{PROC}/{pid}/task") else None
    try:
        tasks = os.listdir(f"{PROC}/{pid}/task")
    except OSError:
        return None
    found: list[int] = []
    for task in tasks:
        data = read_file(f"{PROC}/{pid}/task/{task}/children", CHILDREN_MAX_BYTES)
        children = None if data is None else parse_children(data)
        if children is None and os.path.exists(f"{PROC}/{pid}/task/{task}"):
            return None  # a thread's children cannot be read: not all are known
        found.extend(children or ())
    return found


def _children_by_scan(pid: int) -> list[int]:
    found = []
    for other in pids():
        stat = stat_of(other)
        if stat is not None and stat.parent == pid:
            found.append(other)
    return found


def file_id(path: str) -> FileId | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return FileId(st.st_dev, st.st_ino)


def read_file(path: str, limit: int) -> bytes | None:
    """``path``, at most ``limit`` bytes; None when it is gone, unreadable or larger."""
    chunks: list[bytes] = []
    size = 0
    try:
        with _open(path, "rb", buffering=0) as f:
            while chunk := f.read(min(_CHUNK_BYTES, limit + 1 - size)):
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    return None
    except OSError:
        return None
    return b"".join(chunks)
