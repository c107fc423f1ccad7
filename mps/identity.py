"""Which process is a card's MPS control daemon, and which are its MPS servers (pure).

The node daemon spares a card's MPS servers from enforcement (they are GPU processes in
no container), so who they are must come from facts no container can choose. A process
chooses its argv, its environ and its name; these it cannot:

- the listening unix socket bound at ``<pipe dir>/control``, the one every client
  connects to, as /proc/net/unix lists it, held open by the process
  (``socket:[inode]`` in /proc/PID/fd);
- the file it runs: /proc/PID/exe is that file (its device and inode, not its name),
  or ``<path> (deleted)`` once a package upgrade replaced the file at ``path``. A
  control binary that is a ``#!`` script (the tests' stand-in) runs as its interpreter,
  so a script is run by a process that holds the script file itself open;
- its user: the node daemon's own (root on a node: uid 0, real, effective, saved and
  file system uid alike);
- its mount namespace: the node daemon's own, or the card's own namespace, the one bound
  at ``<run_dir>/mps/ns/<card UUID>`` (mps.namespace: the host's, with the card's tmpfs at
  /dev/shm, made by gpushare-node for the daemons it starts). Every container has a mount
  namespace of its own (every OCI runtime makes one; Kubernetes has no setting to share
  the host's), gpushare-node stays in the host's, and only root in the host's namespace
  can bind a namespace at that path. A process in either is in no container.

The MPS servers are the direct children of that daemon that run the server binary
(the daemon forks, sets the client's uid and execs ``nvidia-cuda-mps-server`` through
its PATH), in the daemon's mount namespace: never a descendant further down, never a
child that runs something else.

Every parser takes bytes as /proc gives them and answers None (or nothing) for what
is not as the kernel writes it: the caller then treats the process as not the daemon
and not a server (fail closed).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

LISTENING = 0x10000  # __SO_ACCEPTCON in the Flags column: the socket called listen()
UNCONNECTED = 0x01  # SS_UNCONNECTED in the St column: what a listening socket shows
# One /proc/net/unix line: "Num: RefCount Protocol Flags Type St Inode[ Path]" (the
# inode right-aligned in 5 columns). The path is the rest, printed as bound, raw.
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
    """A file as the kernel knows it: its device and inode (what a name cannot fake)."""

    dev: int
    ino: int


@dataclass(frozen=True)
class Executable:
    """A program file: where it is, which file that is, and whether it is a ``#!`` script."""

    path: str
    file: FileId
    script: bool


@dataclass(frozen=True)
class Stat:
    """The fields of /proc/PID/stat used here."""

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
    """A process that holds the listening control socket, runs the control binary, as
    the node daemon's user, in a trusted mount namespace (the node daemon's, the card's)."""

    pid: int
    parent: int
    start_ticks: int


@dataclass(frozen=True)
class Child:
    """A direct child of the daemon and what /proc showed of it."""

    pid: int
    parent: int
    start_ticks: int
    zombie: bool
    runs_server: bool  # it runs the MPS server binary (see ``runs``)
    in_daemon_mount_ns: bool


def listening_inodes(lines: Iterable[bytes], path: bytes) -> set[int]:
    """Inodes of the sockets that /proc/net/unix lines list as listening at exactly ``path``.

    The kernel prints a path as bound, newlines included, so a process that binds a
    socket at a path holding "\\n<a line>" adds a line of its own choosing. Such a line
    can only add a claim that some inode listens here; each claim is then checked
    against the process holding that socket (what it runs, its user, its mount
    namespace), and a claim no such process backs finds nothing. A line is never used
    to rule a socket out, so an added line cannot hide the daemon either.
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
    """Inodes of every socket that /proc/net/unix lines list (a line a process printed
    through its bound path may add one: use it only as a hint where to look)."""
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
    """State, parent and start time of /proc/PID/stat (the name, field 2, may hold spaces
    and ')': fields are split after the last ')'); None when malformed."""
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
    """Where execlp looks for ``name``, in order. An empty PATH entry means the
    daemon's working directory, which proves nothing about the file: it is left out."""
    directories = (DEFAULT_SEARCH_PATH if path_env is None else path_env).split(":")
    return [posixpath.join(d, name) for d in directories if d.startswith("/")]


def is_script(head: bytes) -> bool:
    """Whether a file's first bytes make the kernel run it through an interpreter."""
    return head.startswith(b"#!")


def runs(
    exe: FileId | None, exe_link: str | None, held: Collection[FileId], program: Executable
) -> bool:
    """Whether a process runs ``program``: its exe is that file; or its exe is the file
    once at that path, since replaced (an upgrade: the link reads "<path> (deleted)");
    or, for a script, the process holds the script file open (its exe is the interpreter)."""
    if exe is not None and exe == program.file:
        return True
    if exe_link is not None and exe_link == program.path + " (deleted)":
        return True
    return program.script and program.file in held


def choose_daemon(
    candidates: Sequence[Candidate], previous: DaemonIdentity | None = None
) -> DaemonIdentity | None:
    """The control daemon among the processes that pass every test; None when unclear.

    The daemon verified before stays while it still passes. Otherwise exactly one
    candidate must be the parent of all others: a fork of the daemon holds its
    sockets until it execs (an MPS server being started). Two unrelated candidates
    are an ambiguity nobody can settle from /proc: None (fail closed).
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
    """(PID, start ticks) of the daemon's MPS servers: its live direct children that run
    the server binary in the daemon's mount namespace."""
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
