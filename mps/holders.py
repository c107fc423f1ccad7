"""Who holds a card's MPS control daemon (pure): a client that connects and then neither
sends nor reads.

NVIDIA's control daemon serves one client at a time and waits, with no time-out, for
the one it accepted to speak, so a silent client of the card's ``control`` socket stops
it for every tenant. mps.connections reads the daemon's connections from the kernel; a
connection holds the daemon when:

- the same daemon runs (not stopped: a stopped daemon waits on nobody) at both looks;
- it was accepted on the daemon's listening socket (the kernel ties it to the socket's
  file) and the daemon is blocked on exactly its fd (/proc/PID/syscall) waiting for the
  client: reading with nothing unread, or writing with its earlier bytes still unread
  in the client's end;
- two looks in a row saw the same connection and peer so while the card did not answer
  (a legitimate client sends its first message at once);
- its peer is held by neither the node daemon's processes (its control commands) nor
  the control daemon's (the daemon and its MPS servers).

A look that could not see everything (``problem``) judges nobody: the caller says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from mps.identity import DaemonIdentity

# read, pread64, readv, recvfrom, recvmsg, recvmmsg and their write/send counterparts
# (fd first), per asm/unistd_64.h and asm-generic/unistd.h. On another architecture no
# daemon is judged waiting on a client.
READ_SYSCALLS = {
    "x86_64": frozenset({0, 17, 19, 45, 47, 299}),
    "aarch64": frozenset({63, 65, 67, 207, 212, 243}),
}
WRITE_SYSCALLS = {
    "x86_64": frozenset({1, 18, 20, 44, 46, 307}),
    "aarch64": frozenset({64, 66, 68, 206, 211, 269}),
}
READING, WRITING = "reading", "writing"
_MAX_NUMBER_DIGITS = 20


@dataclass(frozen=True)
class Holder:
    """A process holding the client's end of a connection to the control socket."""

    pid: int
    start_ticks: int
    ours: bool = False  # the node daemon or one of its descendants (its control commands)
    daemons: bool = False  # the control daemon or one of its descendants (its MPS servers)


@dataclass(frozen=True)
class Connection:
    """A connection the control daemon accepted on its control socket."""

    fd: int
    inode: int  # the daemon's end
    peer: int | None  # the client's end; None: the client closed it
    unread: int | None  # bytes the client sent that the daemon has not read yet
    blocked: str | None  # READING or WRITING: the daemon is blocked on this connection
    holders: tuple[Holder, ...] = ()
    peer_unread: int | None = None  # bytes the daemon sent that the client has not read


@dataclass(frozen=True)
class Look:
    """What the kernel showed of a control daemon's connections at one moment."""

    daemon: DaemonIdentity
    stopped: bool = False  # the daemon is stopped (SIGSTOP, a tracer): it waits on nobody
    connections: tuple[Connection, ...] = ()
    problem: str | None = None  # why not everything could be seen: nobody is judged


def parse_syscall(data: bytes) -> tuple[int, tuple[int, ...]] | None:
    """/proc/PID/syscall as (number, arguments); None for "running", "-1 ..." (outside a
    system call) or anything malformed."""
    fields = data.split()
    if len(fields) < 2 or not _is_number(fields[0]):
        return None
    arguments = []
    for field in fields[1:7]:
        if not field.startswith(b"0x") or len(field) > 18:
            return None
        try:
            arguments.append(int(field[2:], 16))
        except ValueError:
            return None
    return int(fields[0]), tuple(arguments)


def blocked_on(syscall: tuple[int, tuple[int, ...]] | None, machine: str) -> tuple[str, int] | None:
    """(READING or WRITING, fd) of a process blocked in a read- or write-family call."""
    if syscall is None or not syscall[1]:
        return None
    number, arguments = syscall
    if number in READ_SYSCALLS.get(machine, ()):
        return READING, arguments[0]
    if number in WRITE_SYSCALLS.get(machine, ()):
        return WRITING, arguments[0]
    return None


def holding(before: Look | None, after: Look) -> list[Connection]:
    """The connections of ``after`` that hold the daemon (see the module)."""
    if before is None or before.problem is not None or after.problem is not None:
        return []
    if before.daemon != after.daemon or before.stopped or after.stopped:
        return []
    earlier = {(c.inode, c.peer): c for c in before.connections if _waits_on_client(c)}
    held = []
    for connection in after.connections:
        if not _waits_on_client(connection) or (connection.inode, connection.peer) not in earlier:
            continue
        if any(h.ours or h.daemons for h in connection.holders) or not connection.holders:
            continue
        held.append(connection)
    return held


def waiting(look: Look) -> list[Connection]:
    """Connections on which the daemon waits for a client other than ours or its own
    (held once a later look shows the same)."""
    if look.problem is not None or look.stopped:
        return []
    return [
        c
        for c in look.connections
        if _waits_on_client(c) and c.holders and not any(h.ours or h.daemons for h in c.holders)
    ]


def _waits_on_client(connection: Connection) -> bool:
    if connection.peer is None:
        return False
    if connection.blocked == READING:
        return connection.unread == 0
    if connection.blocked == WRITING:
        return connection.peer_unread is not None and connection.peer_unread > 0
    return False


def _is_number(field: bytes) -> bool:
    return field.isdigit() and len(field) <= _MAX_NUMBER_DIGITS
