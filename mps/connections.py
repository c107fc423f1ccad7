"""A control daemon's connections on its control socket, and who holds their other end.

What mps.holders judges, read from the kernel:

- the daemon's sockets: the ``socket:[inode]`` links of /proc/PID/fd;
- which are connections accepted on ``control`` or ``control_privileged``, their peer
  and what waits unread in either end: sock_diag (mps.sockdiag), asked in our network
  namespace, then in those whose /proc/PID/net/unix lists the socket (an accepted
  socket lives in the client's namespace), then of the socket itself for a namespace
  no process is in any more (mps.sockdiag.namespace_of). /proc/net/unix lines can be
  forged, so they only say where to ask; only sock_diag's answer for a socket bound
  to one of those files (device and inode) counts;
- what the daemon is blocked on: /proc/PID/syscall;
- who holds each peer: processes' ``socket:[inode]`` links, with start time and
  whether they descend from the node daemon or the control daemon. The namespace the
  connection was found in is read first, the rest of the process table only when none
  there holds it (a passed-on socket is found at a later look). Many fds slow this
  walk (a million take a second or two) but cannot hide a holder.

What cannot be read becomes the look's ``problem`` (nobody is judged), never an
exception. The process table is walked only when asked, within ``deadline_seconds``.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Iterable

from mps import proc, sockdiag
from mps.holders import Connection, Holder, Look, blocked_on, parse_syscall
from mps.identity import DaemonIdentity, FileId, socket_inode

SYSCALL_MAX_BYTES = 256
MAX_PARENT_STEPS = 64  # deeper than any real process tree; a longer chain is not followed
DEADLINE_SECONDS = 60.0


def look(
    daemon: DaemonIdentity, pipe_dir: str, ours: int, deadline_seconds: float = DEADLINE_SECONDS
) -> Look:
    """The connections ``daemon`` accepted on ``<pipe_dir>/control`` (or
    ``control_privileged``) now; ``ours``: the node daemon's PID."""
    deadline = time.monotonic() + deadline_seconds
    stat = proc.stat_of(daemon.pid)
    if stat is None or stat.start_ticks != daemon.start_ticks or stat.state == "Z":
        return Look(daemon, problem=f"the control daemon (pid {daemon.pid}) is gone")
    stopped = stat.state in ("T", "t")
    control = proc.file_id(os.path.join(pipe_dir, "control"))
    if control is None:
        return Look(daemon, stopped, problem=f"{pipe_dir}/control cannot be read")
    listening = {control, proc.file_id(os.path.join(pipe_dir, "control_privileged"))}
    files = {(sockdiag.device_number(f.dev), f.ino) for f in listening if f is not None}
    sockets = daemon_sockets(daemon.pid)
    syscall = proc.read_file(f"{proc.PROC}/{daemon.pid}/syscall", SYSCALL_MAX_BYTES)
    if sockets is None or syscall is None:
        unreadable = f"/proc/{daemon.pid}/fd or /proc/{daemon.pid}/syscall cannot be read"
        return Look(daemon, stopped, problem=unreadable)
    blocked = blocked_on(parse_syscall(syscall), platform.machine())
    try:
        records, where = find_sockets(sockets, daemon.pid, deadline)
    except sockdiag.SockDiagError as e:
        return Look(daemon, stopped, problem=str(e))
    accepted = []
    for fd, inode in sorted(sockets.items()):
        record = records.get(inode)
        if record is None or record.state != sockdiag.ESTABLISHED or record.file not in files:
            continue
        accepted.append((fd, record))
    peers = {record.peer: where[record.inode] for _, record in accepted if record.peer}
    held = holders(peers, daemon, ours, deadline) if peers else {}
    if held is None:
        return Look(
            daemon,
            stopped,
            problem=f"the process table was not read through within {deadline_seconds:g} s",
        )
    connections = tuple(
        Connection(
            fd,
            record.inode,
            record.peer,
            record.unread,
            blocked=blocked[0] if blocked is not None and blocked[1] == fd else None,
            holders=tuple(held.get(record.peer, ())) if record.peer is not None else (),
            peer_unread=_unread(records, record.peer),
        )
        for fd, record in accepted
    )
    again = proc.stat_of(daemon.pid)
    if again is None or again.start_ticks != stat.start_ticks or again.state == "Z":
        return Look(daemon, stopped, problem="the control daemon exited while it was read")
    return Look(daemon, stopped, connections)


def _unread(records: dict[int, sockdiag.UnixSocket], inode: int | None) -> int | None:
    record = records.get(inode) if inode is not None else None
    return None if record is None else record.unread


def daemon_sockets(pid: int) -> dict[int, int] | None:
    """fd -> socket inode of every socket the process holds; None when unreadable."""
    directory = f"{proc.PROC}/{pid}/fd"
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    if len(names) > proc.MAX_FDS:
        return None
    found = {}
    for name in names:
        try:
            inode = socket_inode(os.readlink(f"{directory}/{name}"))
        except OSError:
            continue  # closed meanwhile
        if inode is not None and name.isdigit():
            found[int(name)] = inode
    return found


def find_sockets(
    sockets: dict[int, int], daemon_pid: int, deadline: float
) -> tuple[dict[int, sockdiag.UnixSocket], dict[int, FileId | None]]:
    """sock_diag's records of the daemon's ``sockets`` (fd -> inode) and their peers, and
    the network namespace each was found in (order: see the module). SockDiagError when
    sock_diag cannot be asked, or the namespaces are not looked through by ``deadline``."""
    inodes = set(sockets.values())
    own_ns = proc.file_id(f"{proc.PROC}/self/ns/net")
    with sockdiag.DiagSocket() as ours:
        found = _with_peers(ours, inodes)
    where: dict[int, FileId | None] = dict.fromkeys(found, own_ns)
    missing = inodes - set(found)
    for pid, namespace in _one_per_network_namespace(own_ns) if missing else ():
        if time.monotonic() > deadline:
            raise sockdiag.SockDiagError(
                "the network namespaces were not looked through in time for the control "
                f"daemon's sockets {sorted(missing)}"
            )
        listed = proc.sockets_listed(pid) & missing
        if not listed:
            continue
        try:
            with sockdiag.DiagSocket(f"{proc.PROC}/{pid}/ns/net") as theirs:
                answered = _with_peers(theirs, listed)
        except sockdiag.SockDiagError:
            if proc.stat_of(pid) is None:
                continue  # gone, and with it our way into its namespace
            raise
        found.update(answered)
        where.update(dict.fromkeys(answered, namespace))
        missing -= set(answered)
        if not missing:
            break
    for fd, inode in sockets.items():
        if inode in missing and time.monotonic() <= deadline:
            answered, own = _in_own_namespace(daemon_pid, fd, inode)
            found.update(answered)
            where.update(dict.fromkeys(answered, own))
    return found, where


def _in_own_namespace(
    daemon_pid: int, fd: int, inode: int
) -> tuple[dict[int, sockdiag.UnixSocket], FileId | None]:
    """The socket ``inode`` (the daemon's ``fd``) and its peer, asked in the namespace the
    socket itself says it is in; nothing when it cannot say (closed meanwhile)."""

    def start_ticks(pid: int) -> int | None:
        stat = proc.stat_of(pid)
        return None if stat is None else stat.start_ticks

    try:
        namespace_fd = sockdiag.namespace_of(daemon_pid, fd, start_ticks)
    except sockdiag.SockDiagError:
        return {}, None
    try:
        path = f"{proc.PROC}/self/fd/{namespace_fd}"
        with sockdiag.DiagSocket(path) as theirs:
            answered = _with_peers(theirs, {inode})
        return (answered, proc.file_id(path)) if inode in answered else ({}, None)
    finally:
        os.close(namespace_fd)


def _with_peers(diag: sockdiag.DiagSocket, inodes: set[int]) -> dict[int, sockdiag.UnixSocket]:
    """``inodes`` as one namespace's sock_diag shows them, and their connected peers."""
    found = diag.sockets_of(inodes)
    peers = {r.peer for r in found.values() if r.state == sockdiag.ESTABLISHED and r.peer}
    found.update(diag.sockets_of(peers - set(found)))
    return found


def _one_per_network_namespace(own: FileId | None) -> Iterable[tuple[int, FileId]]:
    seen = {own}
    for pid in proc.pids():
        namespace = proc.file_id(f"{proc.PROC}/{pid}/ns/net")
        if namespace is not None and namespace not in seen:
            seen.add(namespace)
            yield pid, namespace


def holders(
    peers: dict[int, FileId | None], daemon: DaemonIdentity, ours: int, deadline: float
) -> dict[int, list[Holder]] | None:
    """Peer inode -> the processes holding it, the control daemon left out; ``peers``:
    each peer's namespace (see the module). None when not done by ``deadline``."""
    links = {f"socket:[{peer}]": peer for peer in peers}
    namespaces = set(peers.values())
    found: dict[int, list[Holder]] = {}
    later = []
    for pid in proc.pids():
        if proc.file_id(f"{proc.PROC}/{pid}/ns/net") in namespaces:
            if not _note_holder(pid, links, daemon, ours, found, deadline):
                return None
        else:
            later.append(pid)
    unheld = {link: peer for link, peer in links.items() if peer not in found}
    for pid in later if unheld else ():
        if not _note_holder(pid, unheld, daemon, ours, found, deadline):
            return None
    return found


def _note_holder(
    pid: int,
    links: dict[str, int],
    daemon: DaemonIdentity,
    ours: int,
    found: dict[int, list[Holder]],
    deadline: float,
) -> bool:
    """False once past ``deadline``."""
    if time.monotonic() > deadline:
        return False
    if pid == daemon.pid:
        return True
    held = _holds(pid, links)
    if not held:
        return True
    stat = proc.stat_of(pid)
    if stat is None or stat.state == "Z":
        return True  # gone meanwhile
    chain = _ancestors(pid)
    holder = Holder(
        pid, stat.start_ticks, ours=pid == ours or ours in chain, daemons=daemon.pid in chain
    )
    for peer in held:
        found.setdefault(peer, []).append(holder)
    return True


def _holds(pid: int, links: dict[str, int]) -> set[int]:
    directory = f"{proc.PROC}/{pid}/fd"
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    held = set()
    for name in names:
        try:
            link = os.readlink(f"{directory}/{name}")
        except OSError:
            continue
        peer = links.get(link)
        if peer is not None:
            held.add(peer)
    return held


def _ancestors(pid: int) -> set[int]:
    chain = set()
    for _ in range(MAX_PARENT_STEPS):
        stat = proc.stat_of(pid)
        if stat is None or stat.parent <= 0:
            break
        pid = stat.parent
        chain.add(pid)
    return chain
