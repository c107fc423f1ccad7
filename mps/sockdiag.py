"""Unix sockets as the kernel's sock_diag netlink interface shows them (UNIX_DIAG).

/proc/net/unix does not say what a socket is connected to. sock_diag
(``NETLINK_SOCK_DIAG``, ``AF_UNIX``) gives per socket its peer's inode
(``UDIAG_SHOW_PEER``), the device and inode of the file it is bound to
(``UDIAG_SHOW_VFS``: an accepted socket carries its listener's file, so a connection to
a control socket is known by that file, not by a path a process could choose) and what
waits unread in it (``UDIAG_SHOW_RQLEN``). Read with ``socket`` and ``struct`` over the
fixed layouts of ``linux/netlink.h``, ``linux/sock_diag.h`` and ``linux/unix_diag.h``.

A socket accepted on a listener is made in the *connecting* socket's network namespace,
where the host's sock_diag does not see it, so ``DiagSocket`` opens its netlink socket
inside a given namespace (``setns`` in a thread made for that alone: the socket stays
in the namespace it was made in). ``namespace_of`` asks a socket itself for its
namespace (``pidfd_getfd``, then ``SIOCGSKNS``), for a namespace no process is in any
more.

The parsers are pure and refuse what is not as the kernel writes it; the I/O raises
``SockDiagError`` naming what failed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
CLONE_NEWNET = 0x40000000
SIOCGSKNS = 0x894C  # linux/sockios.h: a socket's network namespace, as a new fd
SYS_PIDFD_GETFD = 438  # the same number on every architecture (asm-generic/unistd.h)

# linux/unix_diag.h
UDIAG_SHOW_NAME = 0x01
UDIAG_SHOW_VFS = 0x02
UDIAG_SHOW_PEER = 0x04
UDIAG_SHOW_RQLEN = 0x10
UNIX_DIAG_NAME = 0
UNIX_DIAG_VFS = 1
UNIX_DIAG_PEER = 2
UNIX_DIAG_RQLEN = 4
# A unix socket's state uses the TCP numbers (include/net/tcp_states.h).
ESTABLISHED = 1
LISTEN = 10
ALL_STATES = 0xFFFFFFFF
NO_COOKIE = 0xFFFFFFFF  # INET_DIAG_NOCOOKIE: the inode alone names the socket

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_NLMSGERR = struct.Struct("=i")  # the (negative) errno that starts an NLMSG_ERROR
_UNIX_DIAG_REQ = struct.Struct("=BBHIIIII")  # family, protocol, pad, states, ino, show, cookie[2]
_UNIX_DIAG_MSG = struct.Struct("=BBBBIII")  # family, type, state, pad, ino, cookie[2]
_NLATTR = struct.Struct("=HH")  # len, type
_U32 = struct.Struct("=I")
_U32_PAIR = struct.Struct("=II")

SHOW = UDIAG_SHOW_NAME | UDIAG_SHOW_VFS | UDIAG_SHOW_PEER | UDIAG_SHOW_RQLEN
_RECEIVE_BYTES = 64 * 1024  # one answer is a few dozen bytes
TIMEOUT_SECONDS = 2.0  # the kernel answers at once; a socket that does not is broken


class SockDiagError(Exception):
    """sock_diag cannot be asked (no such netlink family, namespace not enterable, a
    malformed answer); the message says which."""


@dataclass(frozen=True)
class UnixSocket:
    inode: int
    type: int  # socket.SOCK_STREAM, SOCK_DGRAM or SOCK_SEQPACKET
    state: int  # ESTABLISHED, LISTEN, ... (TCP numbers)
    name: bytes | None  # the bound address (a path, or b"\0..." abstract); None: unbound
    file: tuple[int, int] | None  # (device, inode) of the socket file bound to, if any
    peer: int | None  # the inode of the socket it is connected to; None: none
    # Connected: bytes waiting in it, unread; listening: connections not yet accepted.
    unread: int | None


def request(inode: int, seq: int, show: int = SHOW) -> bytes:
    """A sock_diag request for the one unix socket with this inode."""
    body = _UNIX_DIAG_REQ.pack(socket.AF_UNIX, 0, 0, ALL_STATES, inode, show, NO_COOKIE, NO_COOKIE)
    header = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0)
    return header + body


def parse_answer(data: bytes, seq: int) -> tuple[list[UnixSocket], int | None]:
    """The sockets in one datagram of answers to request ``seq`` (other requests' skipped),
    and the errno of an NLMSG_ERROR among them (0 is an acknowledgement)."""
    found: list[UnixSocket] = []
    error: int | None = None
    for kind, message_seq, payload in _messages(data):
        if message_seq != seq:
            continue
        if kind == NLMSG_ERROR:
            if len(payload) < _NLMSGERR.size:
                raise SockDiagError("a truncated netlink error message")
            (code,) = _NLMSGERR.unpack_from(payload)
            error = -code
        elif kind == SOCK_DIAG_BY_FAMILY:
            found.append(parse_socket(payload))
        elif kind != NLMSG_DONE:
            raise SockDiagError(f"an unexpected netlink message type {kind}")
    return found, error


def _messages(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    offset = 0
    while offset < len(data):
        if len(data) - offset < _NLMSGHDR.size:
            raise SockDiagError("a truncated netlink message header")
        length, kind, _, seq, _ = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size or offset + length > len(data):
            raise SockDiagError(f"a netlink message of {length} bytes in {len(data) - offset}")
        yield kind, seq, data[offset + _NLMSGHDR.size : offset + length]
        offset += _align(length)


def parse_socket(payload: bytes) -> UnixSocket:
    if len(payload) < _UNIX_DIAG_MSG.size:
        raise SockDiagError("a truncated unix_diag_msg")
    family, kind, state, _, inode, _, _ = _UNIX_DIAG_MSG.unpack_from(payload)
    if family != socket.AF_UNIX:
        raise SockDiagError(f"a sock_diag answer of address family {family}, not AF_UNIX")
    name = file = peer = unread = None
    for attribute, value in attributes(payload[_UNIX_DIAG_MSG.size :]):
        if attribute == UNIX_DIAG_NAME:
            # A path comes with its terminating NUL; an abstract name starts with one.
            name = value[:-1] if value.endswith(b"\0") and not value.startswith(b"\0") else value
        elif attribute == UNIX_DIAG_VFS:
            file_inode, device = _pair(value, "UNIX_DIAG_VFS")
            file = (device, file_inode)
        elif attribute == UNIX_DIAG_PEER:
            if len(value) != _U32.size:
                raise SockDiagError(f"UNIX_DIAG_PEER of {len(value)} bytes")
            (peer,) = _U32.unpack(value)
        elif attribute == UNIX_DIAG_RQLEN:
            unread, _ = _pair(value, "UNIX_DIAG_RQLEN")
    return UnixSocket(inode, kind, state, name, file, peer, unread)


def attributes(data: bytes) -> Iterator[tuple[int, bytes]]:
    offset = 0
    while offset < len(data):
        if len(data) - offset < _NLATTR.size:
            raise SockDiagError("a truncated netlink attribute")
        length, kind = _NLATTR.unpack_from(data, offset)
        if length < _NLATTR.size or offset + length > len(data):
            raise SockDiagError(f"a netlink attribute of {length} bytes in {len(data) - offset}")
        yield kind & 0x3FFF, data[offset + _NLATTR.size : offset + length]  # no flag bits
        offset += _align(length)


def _pair(value: bytes, what: str) -> tuple[int, int]:
    if len(value) != _U32_PAIR.size:
        raise SockDiagError(f"{what} of {len(value)} bytes")
    first, second = _U32_PAIR.unpack(value)
    return first, second


def _align(length: int) -> int:
    return (length + 3) & ~3


def device_number(st_dev: int) -> int:
    """``os.stat``'s st_dev as UNIX_DIAG_VFS gives it: the kernel's own dev_t, major
    in the 12 bits above a 20-bit minor (``MKDEV``), not the encoding stat uses."""
    return (os.major(st_dev) << 20) | os.minor(st_dev)


# --- the netlink socket -----------------------------------------------------------------------


class DiagSocket:
    """A sock_diag netlink socket in one network namespace (a file such as
    ``/proc/PID/ns/net``; None: ours)."""

    def __init__(self, netns: str | None = None):
        self.netns = netns
        self._seq = 0
        self._socket = _open(netns)

    def __enter__(self) -> DiagSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._socket.close()

    def socket_of(self, inode: int) -> UnixSocket | None:
        """The unix socket with this inode in the namespace; None when it has none."""
        self._seq += 1
        seq = self._seq
        try:
            self._socket.send(request(inode, seq))
            while True:
                data = self._socket.recv(_RECEIVE_BYTES)
                found, error = parse_answer(data, seq)
                if found:
                    return found[0]
                if error == errno.ENOENT:
                    return None
                if error:
                    raise SockDiagError(
                        f"sock_diag refused the question for socket {inode}: {os.strerror(error)}"
                    )
        except OSError as e:
            raise SockDiagError(f"sock_diag did not answer for socket {inode}: {e}") from e

    def sockets_of(self, inodes: Iterable[int]) -> dict[int, UnixSocket]:
        """Those of ``inodes`` that are unix sockets of the namespace."""
        found = {}
        for inode in inodes:
            record = self.socket_of(inode)
            if record is not None:
                found[inode] = record
        return found


def _new_socket() -> socket.socket:
    diag = socket.socket(
        socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG
    )
    diag.settimeout(TIMEOUT_SECONDS)
    return diag


def _open(netns: str | None) -> socket.socket:
    if netns is None:
        try:
            return _new_socket()
        except OSError as e:
            raise SockDiagError(f"cannot open a sock_diag netlink socket: {e}") from e
    made: list[socket.socket] = []
    failed: list[BaseException] = []

    def enter() -> None:
        try:
            fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(fd, CLONE_NEWNET)
            finally:
                os.close(fd)
            made.append(_new_socket())
        except BaseException as e:  # handed to the caller's thread
            failed.append(e)

    thread = threading.Thread(target=enter, name="sockdiag-netns", daemon=True)
    thread.start()
    thread.join()
    if failed or not made:
        why = failed[0] if failed else "no socket made"
        raise SockDiagError(f"cannot ask sock_diag in the network namespace {netns}: {why}")
    return made[0]


def _setns(fd: int, nstype: int) -> None:
    setns = getattr(os, "setns", None)  # Python 3.12 and later
    if setns is not None:
        setns(fd, nstype)
        return
    import ctypes  # only on Python 3.11, and only when another namespace is entered

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def namespace_of(pid: int, fd: int, start_ticks_of) -> int:
    """A new fd (close it) of the network namespace of process ``pid``'s socket ``fd``;
    ``start_ticks_of`` proves the pidfd names the process meant, not a reused PID."""
    before = start_ticks_of(pid)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as e:
        raise SockDiagError(f"process {pid} cannot be opened: {e}") from e
    try:
        if before is None or start_ticks_of(pid) != before:
            raise SockDiagError(f"process {pid} is gone")
        duplicate = _pidfd_getfd(pidfd, fd)
    finally:
        os.close(pidfd)
    try:
        return fcntl.ioctl(duplicate, SIOCGSKNS)
    except OSError as e:
        raise SockDiagError(f"the network namespace of socket fd {fd} of {pid}: {e}") from e
    finally:
        os.close(duplicate)


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    import ctypes  # the standard library has no pidfd_getfd

    libc = ctypes.CDLL(None, use_errno=True)
    duplicate = libc.syscall(
        ctypes.c_long(SYS_PIDFD_GETFD), ctypes.c_int(pidfd), ctypes.c_int(fd), ctypes.c_uint(0)
    )
    if duplicate < 0:
        code = ctypes.get_errno()
        raise SockDiagError(f"pidfd_getfd of fd {fd}: {os.strerror(code)}")
    return int(duplicate)
