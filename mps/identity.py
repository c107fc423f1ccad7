"""Which process is a card's MPS control daemon, and which are its MPS servers (pure).

The node daemon spares a card's MPS servers from enforcement (GPU processes in no
container), so who they are must come from facts no container can choose. A process
chooses its argv, environ and name; not these:

- it holds open (``socket:[inode]`` in /proc/PID/fd) the listening unix socket bound at
  ``<pipe dir>/control``, as /proc/net/unix lists it;
- it runs the control binary: /proc/PID/exe is that file (device and inode), or
  ``<path> (deleted)`` once an upgrade replaced it. A ``#!`` script (the tests'
  stand-in) runs as its interpreter, which holds the script file open;
- its user is the node daemon's (uid 0 real, effective, saved and file system alike);
- its mount namespace is the node daemon's or the card's, bound at
  ``<run_dir>/mps/ns/<card UUID>`` (mps.namespace). Every OCI runtime gives each
  container a mount namespace of its own and only root in the host's namespace can bind
  one at that path, so a process in either is in no container.

The MPS servers are the daemon's direct children running the server binary (it forks,
sets the client's uid and execs ``nvidia-cuda-mps-server`` through its PATH) in its
mount namespace: never a grandchild, never a child running something else.

Parsers take /proc's bytes and answer None for anything not as the kernel writes it:
the process is then neither the daemon nor a server (fail closed).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

LISTENING = 0x10000  # __SO_ACCEPTCON in the Flags column: the socket called listen()
UNCONNECTED = 0x01  # SS_UNCONNECTED in the St column: what a listening socket shows
# "Num: RefCount Protocol Flags Type St Inode[ Path]"; the path is printed raw, as bound.
_UNIX_LINE = re.compile(
    rb"[0-9a-fA-F]+: [0-9A-F]{8} [0-9A-F]{8} ([0-9A-F]{8}) [0-9A-F]{4} ([0-9A-F]{2}) +"
    rb"([0-9]{1,20})(?: (.*))?",
    re.DOTALL,
)
_SOCKET_LINK = re.compile(r"socket:\[([0-9]{1,20})\]")
_MAX_NUMBER_DIGITS = 20  # a 64-bit unsigned number
DEFAULT_SEARCH_PATH = "/bin:/usr/bin"  # where execlp looks when PATH is not set (glibc)


@dataclass(frozen=True)
class FileId:
    """A file's device and inode (what a name cannot fake)."""

    dev: int
    ino: int


@dataclass(frozen=True)
class Executable:
    path: str
    file: FileId
    script: bool


@dataclass(frozen=True)
class Stat:
    state: str  # R, S, D, Z, ... (one ASCII letter)
    parent: int
    start_ticks: int  # clock ticks since boot: with the PID, names one process


@dataclass(frozen=True)
class DaemonIdentity:
    """The verified control daemon: its PID and start time (a reused PID is another)."""

    pid: int
    start_ticks: int


@dataclass(frozen=True)
class Candidate:
    """A process that passes every test of the module but the choice among several."""

    pid: int
    parent: int
    start_ticks: int


@dataclass(frozen=True)
class Child:
    pid: int
    parent: int
    start_ticks: int
    zombie: bool
    runs_server: bool  # it runs the MPS server binary (see ``runs``)
    in_daemon_mount_ns: bool


def listening_inodes(lines: Iterable[bytes], path: bytes) -> set[int]:
    """Inodes of the sockets /proc/net/unix lines list as listening at exactly ``path``.

    A bound path may hold a newline, so a process can add a line of its choosing. Such a
    line only adds a claim, checked against the process holding that socket; a line never
    rules a socket out, so it cannot hide the daemon either.
    """
    found = set()
    for line in lines:
        match = _UNIX_LINE.fullmatch(line.removesuffix(b"\n"))
        if match is None:
            continue
        flags, state = int(match.group(1), 16), int(match.group(2), 16)
        if flags & LISTENING and state == UNCONNECTED and match.group(4) == path:
            found.add(int(match.group(3)))
    return found


def listed_inodes(lines: Iterable[bytes]) -> set[int]:
    """Inodes of every socket /proc/net/unix lines list (a forged line may add one: only
    a hint where to look)."""
    found = set()
    for line in lines:
        match = _UNIX_LINE.fullmatch(line.removesuffix(b"\n"))
        if match is not None:
            found.add(int(match.group(3)))
    return found


def socket_inode(link: str) -> int | None:
    """The inode of a ``socket:[N]`` fd link; None for any other link."""
    match = _SOCKET_LINK.fullmatch(link)
    return None if match is None else int(match.group(1))


def parse_stat(data: bytes) -> Stat | None:
    """/proc/PID/stat, split after the last ')' (the name may hold spaces and ')');
    None when malformed."""
    close = data.rfind(b")")
    fields = data[close + 2 :].split() if close >= 0 else []
    if len(fields) < 20:
        return None
    state, parent, start = fields[0], fields[1], fields[19]
    if len(state) != 1 or not (state.isascii() and state.isalpha()):
        return None
    if not all(_is_number(field) for field in (parent, start)):
        return None
    return Stat(state.decode("ascii"), int(parent), int(start))


def parse_uids(status: bytes) -> tuple[int, ...] | None:
    """Real, effective, saved and file system uid of /proc/PID/status; None when malformed."""
    for line in status.split(b"\n"):
        name, sep, rest = line.partition(b":")
        if sep and name == b"Uid":
            uids = rest.split()
            if len(uids) != 4 or not all(_is_number(uid) for uid in uids):
                return None
            return tuple(int(uid) for uid in uids)
    return None


def parse_children(data: bytes) -> list[int] | None:
    """The PIDs of /proc/PID/task/TID/children (space-separated); None when malformed."""
    words = data.split()
    if not all(_is_number(word) for word in words):
        return None
    return [int(word) for word in words]


def environ_path(data: bytes) -> str | None:
    """PATH of an environ block (the first entry wins, as getenv() sees it); None when
    unset or not UTF-8 (then the caller looks where execlp looks without PATH)."""
    for entry in data.split(b"\0"):
        if entry.startswith(b"PATH="):
            try:
                return entry[len(b"PATH=") :].decode("utf-8")
            except UnicodeDecodeError:
                return None
    return None


def search_path(path_env: str | None, name: str) -> list[str]:
    """Where execlp looks for ``name``, in order; relative entries (the working
    directory) prove nothing about the file and are left out."""
    directories = (DEFAULT_SEARCH_PATH if path_env is None else path_env).split(":")
    return [posixpath.join(d, name) for d in directories if d.startswith("/")]


def is_script(head: bytes) -> bool:
    """Whether a file's first bytes make the kernel run it through an interpreter."""
    return head.startswith(b"#!")


def runs(
    exe: FileId | None, exe_link: str | None, held: Collection[FileId], program: Executable
) -> bool:
    """Whether a process runs ``program`` (see the module)."""
    if exe is not None and exe == program.file:
        return True
    if exe_link is not None and exe_link == program.path + " (deleted)":
        return True
    return program.script and program.file in held


def choose_daemon(
    candidates: Sequence[Candidate], previous: DaemonIdentity | None = None
) -> DaemonIdentity | None:
    """The control daemon among the candidates; None when unclear (fail closed).

    The daemon verified before stays while it passes. Otherwise exactly one candidate
    must be the parent of all others: a fork of the daemon holds its sockets until it
    execs an MPS server. Two unrelated candidates cannot be told apart from /proc.
    """
    identities = {DaemonIdentity(c.pid, c.start_ticks) for c in candidates}
    if previous is not None and previous in identities:
        return previous
    pids = {c.pid for c in candidates}
    roots = [c for c in candidates if c.parent not in pids]
    if len(roots) != 1:
        return None
    [root] = roots
    if any(c.parent != root.pid for c in candidates if c is not root):
        return None
    return DaemonIdentity(root.pid, root.start_ticks)


def choose_servers(daemon: DaemonIdentity, children: Iterable[Child]) -> frozenset[tuple[int, int]]:
    """(PID, start ticks) of the daemon's live MPS servers (see the module)."""
    return frozenset(
        (child.pid, child.start_ticks)
        for child in children
        if child.parent == daemon.pid
        and not child.zombie
        and child.runs_server
        and child.in_daemon_mount_ns
    )


def _is_number(field: bytes) -> bool:
    # bytes.isdigit() is ASCII digits only; int() would also take '_', '+' and spaces.
    return field.isdigit() and len(field) <= _MAX_NUMBER_DIGITS
