"""Process creation and exit from the kernel's netlink process connector.

``ProcEvents.read()`` blocks until the kernel reports something (or
``timeout_seconds`` pass) and returns the PIDs that exec'd and the PIDs that
exited since the last call. The connector needs CAP_NET_ADMIN and a kernel
built with CONFIG_PROC_EVENTS; where it is missing ``ProcEvents()`` raises
ProcEventsUnavailable saying why, and the watchdog relies on its periodic
scan alone.

The socket is read and parsed with the standard library (``socket`` and
``struct`` over the fixed layouts of ``linux/netlink.h``, ``linux/connector.h``
and ``linux/cn_proc.h``). pyroute2 did this before: importing it cost the
daemon ~22 MiB and 310 modules, its ``get()`` ran an asyncio loop per call and
buffered all but one message, and its ``control(listen=False)`` waited for a
reply a quiet node never sends. Every event on the machine passes through
here (tens to hundreds per second on a busy node), so the parse keeps only
exec and process-exit PIDs and drops everything else after one ``unpack``.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
from dataclasses import dataclass, field

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1  # the connector's process events channel (and its multicast group)
CN_VAL_PROC = 1
NLMSG_DONE = 3
PROC_CN_MCAST_LISTEN = 1
PROC_CN_MCAST_IGNORE = 2
PROC_EVENT_EXEC = 0x00000002
PROC_EVENT_EXIT = 0x80000000

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_CN_MSG = struct.Struct("=IIIIHH")  # idx, val, seq, ack, len, flags
_EVENT_HEAD = struct.Struct("=IIQ")  # what, cpu, timestamp_ns
_PIDS = struct.Struct("=II")  # process_pid, process_tgid: first in exec and exit data
_EVENT_OFFSET = _NLMSGHDR.size + _CN_MSG.size
_PIDS_OFFSET = _EVENT_OFFSET + _EVENT_HEAD.size

_DATAGRAM_BYTES = 1 << 16  # a netlink datagram is far smaller
_MAX_DATAGRAMS_PER_READ = 4096  # a fork storm is read in bounded batches
_RECEIVE_BUFFER_BYTES = 4 << 20  # room for bursts; overflow is reported as ``lost``


class ProcEventsUnavailable(Exception):
    pass


@dataclass
class Events:
    execs: set[int] = field(default_factory=set)  # thread group ids that called exec
    exits: set[int] = field(default_factory=set)  # processes (thread group leaders) gone
    lost: bool = False  # the kernel dropped events (socket buffer full): rescan


def parse_datagram(data: bytes) -> tuple[set[int], set[int]]:
    """(exec'd PIDs, exited PIDs) of one datagram; anything malformed ends the parse."""
    execs: set[int] = set()
    exits: set[int] = set()
    offset = 0
    while offset + _PIDS_OFFSET + _PIDS.size <= len(data):
        length = _NLMSGHDR.unpack_from(data, offset)[0]
        if length < _PIDS_OFFSET + _PIDS.size or offset + length > len(data):
            break
        what = _EVENT_HEAD.unpack_from(data, offset + _EVENT_OFFSET)[0]
        if what == PROC_EVENT_EXEC:
            execs.add(_PIDS.unpack_from(data, offset + _PIDS_OFFSET)[1])
        elif what == PROC_EVENT_EXIT:
            pid, tgid = _PIDS.unpack_from(data, offset + _PIDS_OFFSET)
            if pid == tgid:  # a thread's exit is not the process's
                exits.add(tgid)
        offset += (length + 3) & ~3  # NLMSG_ALIGN
    return execs, exits


def _control_message(operation: int) -> bytes:
    payload = struct.pack("=I", operation)
    cn = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(payload), 0) + payload
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(cn), NLMSG_DONE, 0, 0, 0) + cn


class ProcEvents:
    def __init__(self) -> None:
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
        except OSError as e:
            raise self._unavailable(e) from e
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER_BYTES)
            sock.bind((0, CN_IDX_PROC))
            sock.send(_control_message(PROC_CN_MCAST_LISTEN))
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            raise self._unavailable(e) from e
        self._socket = sock
        # wake() writes here so that a read blocked in select returns at once (a stop).
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # Held by wake() and close(): a closed descriptor's number may be reused by any
        # file, which a late wake() must never write into.
        self._wake_lock = threading.Lock()
        self._closed = False

    @staticmethod
    def _unavailable(error: OSError) -> ProcEventsUnavailable:
        return ProcEventsUnavailable(
            f"cannot listen to the netlink process connector ({error.strerror or error}); it "
            "needs root (CAP_NET_ADMIN) and a kernel with CONFIG_PROC_EVENTS"
        )

    def wake(self) -> None:
        """End a blocked ``read`` now (from another thread); the read returns no events."""
        with self._wake_lock:
            if self._closed:
                return
            try:
                os.write(self._wake_write, b"x")
            except BlockingIOError:  # the pipe is full: a wake is already pending
                pass

    def read(self, timeout_seconds: float) -> Events:
        events = Events()
        ready, _, _ = select.select(
            [self._socket.fileno(), self._wake_read], [], [], timeout_seconds
        )
        if self._wake_read in ready:
            try:
                os.read(self._wake_read, 4096)
            except OSError:
                pass
            return events
        if not ready:
            return events
        # Every datagram waiting is read now (a bounded batch), so select() is asked again
        # only once the socket is empty.
        for _ in range(_MAX_DATAGRAMS_PER_READ):
            try:
                data = self._socket.recv(_DATAGRAM_BYTES)
            except BlockingIOError:
                break
            except OSError:  # ENOBUFS: the kernel dropped events; the caller rescans
                events.lost = True
                break
            execs, exits = parse_datagram(data)
            events.execs |= execs
            events.exits |= exits
        return events

    def close(self) -> None:
        with self._wake_lock:
            if self._closed:
                return
            self._closed = True
            try:  # tell the kernel we stop listening; no answer is awaited
                self._socket.send(_control_message(PROC_CN_MCAST_IGNORE))
            except OSError:
                pass
            self._socket.close()
            os.close(self._wake_read)
            os.close(self._wake_write)
