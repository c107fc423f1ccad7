"""Every socket a process can be reached on, read from the kernel: what it listens on.

A process's sockets are the ``socket:[INODE]`` links in /proc/PID/fd (its threads share
them). Each is looked up in the tables of the process's network namespace
(/proc/PID/net/...), and is a listener when someone else can send to it unasked:

- a unix stream or seqpacket socket in the listening state, or an unconnected datagram
  socket bound to a name; a unix socket is known by the file it is bound to, (device,
  inode) from the kernel's sock_diag (``UDIAG_SHOW_VFS``, read with
  :mod:`mps.sockdiag`): /proc/net/unix shows the name it was bound at, which a socket
  bound in a staging directory and renamed into place no longer has;
- a TCP socket (v4 or v6) in the LISTEN state, known by its address and port;
- a UDP socket (v4 or v6) not connected to a peer (it takes datagrams from anyone);
- a netlink socket that joined a multicast group (it is sent what the group is sent).

Every other socket of the process (a connected client, a netlink socket that only asks
the kernel) is found in some table too, or it is reported as ``unknown``: a socket of a
kind this module cannot judge is not silently taken for harmless.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from mps import sockdiag

TCP_LISTEN = 0x0A
UNIX_LISTENING = 0x00010000  # __SO_ACCEPTCON in /proc/net/unix's Flags


@dataclass(frozen=True)
class Listener:
    """One socket others can send to: its kind and where it is reached."""

    kind: str  # "unix", "tcp", "udp" or "netlink"
    # unix: (device as stat gives it, inode) of the bound file, or its bound name when it
    # has no file (abstract); tcp, udp: (address, port); netlink: (protocol, groups).
    where: tuple
    inode: int  # the socket's own inode
    type: int = socket.SOCK_STREAM  # a unix socket's: SOCK_STREAM, SOCK_SEQPACKET, SOCK_DGRAM


@dataclass(frozen=True)
class Sockets:
    """What one process holds: its listeners, and sockets no table of the kernel names."""

    listeners: tuple[Listener, ...]
    unknown: tuple[int, ...]  # socket inodes found in no table read here


def socket_inodes(pid: int) -> set[int]:
    """The inodes of every socket process ``pid`` holds open."""
    found = set()
    fd_dir = f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except FileNotFoundError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and target.endswith("]"):
            found.add(int(target[len("socket:[") : -1]))
    return found


def parse_inet(text: str, v6: bool) -> list[tuple[int, str, int, str, int, int]]:
    """(inode, local address, local port, remote address, remote port, state) of each line
    of /proc/net/{tcp,udp}[6] (addresses as ``socket.inet_ntop`` writes them)."""
    rows = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
        local_address, local_port = _inet(local, v6)
        remote_address, remote_port = _inet(remote, v6)
        rows.append(
            (int(inode), local_address, local_port, remote_address, remote_port, int(state, 16))
        )
    return rows


def _inet(text: str, v6: bool) -> tuple[str, int]:
    """``0100007F:A005`` -> ("127.0.0.1", 40965): the kernel writes each 32-bit word of the
    address in host byte order (little-endian here), the port in network order."""
    address, port = text.split(":")
    raw = bytes.fromhex(address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET6 if v6 else socket.AF_INET
    return socket.inet_ntop(family, words), int(port, 16)


def parse_unix(text: str) -> dict[int, tuple[int, int, int]]:
    """inode -> (flags, type, state) of each line of /proc/net/unix."""
    rows = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 7:
            continue
        rows[int(fields[6])] = (int(fields[3], 16), int(fields[4], 16), int(fields[5], 16))
    return rows


def parse_netlink(text: str) -> dict[int, tuple[int, int]]:
    """inode -> (protocol, multicast groups) of each line of /proc/net/netlink."""
    rows = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        rows[int(fields[9])] = (int(fields[1]), int(fields[3], 16))
    return rows


def _read(pid: int, name: str) -> str:
    try:
        with open(f"/proc/{pid}/net/{name}") as f:
            return f.read()
    except FileNotFoundError:
        return ""  # no such protocol in this kernel


def sockets_of(pid: int) -> Sockets:
    """The listeners of process ``pid`` and its sockets of no known kind."""
    inodes = socket_inodes(pid)
    found: list[Listener] = []
    known: set[int] = set()
    for kind, tables in (("tcp", ("tcp", "tcp6")), ("udp", ("udp", "udp6"))):
        for table in tables:
            for row in parse_inet(_read(pid, table), table.endswith("6")):
                inode, address, port, _, remote_port, state = row
                if inode not in inodes:
                    continue
                known.add(inode)
                listening = state == TCP_LISTEN if kind == "tcp" else remote_port == 0
                if listening:
                    found.append(Listener(kind, (address, port), inode))
    for inode, (protocol, groups) in parse_netlink(_read(pid, "netlink")).items():
        if inode in inodes:
            known.add(inode)
            if groups:
                found.append(Listener("netlink", (protocol, groups), inode))
    unix = {i: row for i, row in parse_unix(_read(pid, "unix")).items() if i in inodes}
    known |= set(unix)
    found += _unix_listeners(pid, unix)
    return Sockets(tuple(found), tuple(sorted(inodes - known)))


def _unix_listeners(pid: int, unix: dict[int, tuple[int, int, int]]) -> list[Listener]:
    """Of the process's unix sockets (inode -> flags, type, state), those that listen, or
    take datagrams from anyone (bound, not connected)."""
    receiving = [
        inode
        for inode, (flags, kind, state) in unix.items()
        if flags & UNIX_LISTENING or (kind == socket.SOCK_DGRAM and state == 1)
    ]
    if not receiving:
        return []
    found = []
    with sockdiag.DiagSocket(f"/proc/{pid}/ns/net") as diag:
        for inode, record in diag.sockets_of(receiving).items():
            if record.type == socket.SOCK_DGRAM and (record.peer or not record.name):
                continue  # connected, or unbound: nobody else sends to it
            found.append(Listener("unix", unix_where(record), inode, record.type))
    return found


def unix_where(record: sockdiag.UnixSocket) -> tuple:
    """(st_dev as os.stat gives it, st_ino) of the file a unix socket is bound to, or
    ("abstract", name) for one without a file."""
    if record.file is None:
        return ("abstract", record.name)
    device, inode = record.file
    return (os.makedev(device >> 20, device & 0xFFFFF), inode)


def file_key(path: str) -> tuple[int, int]:
    """What :func:`unix_where` gives for a socket bound to the file ``path``."""
    info = os.stat(path)
    return (info.st_dev, info.st_ino)


# --- the listener table of docs/security.md ---------------------------------------------------

TABLE_BEGIN = "<!-- BEGIN listeners"
TABLE_END = "<!-- END listeners -->"
COLUMNS = (
    "listener",
    "process and code",
    "where",
    "who can reach it",
    "what they control",
    "authentication",
    "budget",
    "tests",
)


def listener_table(text: str) -> dict[str, dict[str, str]]:
    """The rows of the listener table in ``text`` (docs/security.md) by listener name (the
    first cell, without its backticks): each a dict of COLUMNS to cell text. ValueError
    when the table is missing or a row is not one of its form."""
    begin, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no listener table ({TABLE_BEGIN} ... {TABLE_END})")
    lines = [line for line in text[begin:end].splitlines()[1:] if line.strip()]
    header = [cell.strip() for cell in lines[0].strip().strip("|").split("|")]
    if tuple(header) != COLUMNS:
        raise ValueError(f"the listener table's columns are {header}, not {list(COLUMNS)}")
    rows: dict[str, dict[str, str]] = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != len(COLUMNS) or not (cells[0].startswith("`") and cells[0].endswith("`")):
            raise ValueError(f"a listener table row not of its form: {line!r}")
        name = cells[0].strip("`")
        if name in rows:
            raise ValueError(f"listener {name} has two rows")
        rows[name] = dict(zip(COLUMNS, cells, strict=True))
    return rows


def resolved(rows: dict[str, dict[str, str]], name: str, column: str) -> str:
    """A cell's text with a leading "as `other`" replaced by that row's cell (resolved too)."""
    text = rows[name][column]
    seen = {name}
    while text.startswith("as `"):
        other = text[len("as `") :].split("`", 1)[0]
        if other in seen or other not in rows:
            raise ValueError(f"{name}'s {column} refers to {other!r}, which it cannot follow")
        seen.add(other)
        text = rows[other][column] + text[len("as `") + len(other) + 1 :]
    return text
