"""Process creation and exit from the kernel's netlink process connector.

The connector needs CAP_NET_ADMIN and CONFIG_PROC_EVENTS; without them ``ProcEvents()``
raises ProcEventsUnavailable saying why, and the watchdog scans periodically alone.

Read with ``socket`` and ``struct`` over the fixed layouts of ``linux/netlink.h``,
``linux/connector.h`` and ``linux/cn_proc.h``, not pyroute2: it costs ~22 MiB and 310
modules at import, its ``get()`` runs an asyncio loop per call and buffers all but one
message, and its ``control(listen=False)`` waits for a reply a quiet node never sends.

The connector multicasts every process event on the machine (tens to hundreds per
second on a busy node); only exec and a process's exit matter. A classic BPF socket
filter (``proc_event_filter``) has the kernel drop the rest, so the reader does not
wake for them; where the kernel refuses it, the parse drops them instead.
"""

from __future__ import annotations

import array
import logging
import select
import socket
import struct
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from nodemgr.common.wakepipe import WakePipe

log = logging.getLogger(__name__)

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

_EVENT_BYTES = _PIDS_OFFSET + _PIDS.size  # the least an exec or exit message holds

# struct sock_filter of linux/filter.h (code, jt, jf, k) and struct sock_fprog (the count,
# then a pointer to the instructions: native layout, padded).
Instruction = tuple[int, int, int, int]
_SOCK_FILTER = struct.Struct("=HBBI")
_SOCK_FPROG = struct.Struct("@HP")
SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)  # asm-generic/socket.h
# The opcodes the filter uses (linux/filter.h: class | size | mode, class | op | source).
_LD_W_ABS, _LD_H_ABS, _LD_B_ABS, _LD_W_LEN = 0x20, 0x28, 0x30, 0x80
_ALU_ADD_K, _ALU_OR_X, _ALU_AND_K, _ALU_LSH_K = 0x04, 0x4C, 0x54, 0x64
_TAX, _RET_K = 0x07, 0x06
_JEQ_K, _JEQ_X, _JGT_X, _JGE_K = 0x15, 0x1D, 0x2D, 0x35
_KEEP_WHOLE = 0xFFFFFFFF  # a filter returns how many bytes to keep; 0 drops the datagram
_NEXT, _ACCEPT, _DROP = 0, -1, -2  # jump targets while the program is assembled

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
    """(exec'd PIDs, exited PIDs); anything malformed ends the parse."""
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


def _as_loaded(value: int, size: int, byteorder: Literal["little", "big"]) -> int:
    """``value`` as a BPF load sees it: stored in the host's order, read big-endian."""
    return int.from_bytes(value.to_bytes(size, byteorder), "big")


def _load_host_word(offset: int, byteorder: Literal["little", "big"]) -> list[Instruction]:
    """Load the host-order 32-bit word at ``offset`` into A as a number (a word load would
    read it byte-swapped on a little-endian host): most significant byte first."""
    if byteorder == "big":
        return [(_LD_W_ABS, _NEXT, _NEXT, offset)]
    steps = [(_LD_B_ABS, _NEXT, _NEXT, offset + 3)]
    for byte in (2, 1, 0):
        steps += [
            (_ALU_LSH_K, _NEXT, _NEXT, 8),
            (_TAX, _NEXT, _NEXT, 0),
            (_LD_B_ABS, _NEXT, _NEXT, offset + byte),
            (_ALU_OR_X, _NEXT, _NEXT, 0),
        ]
    return steps


def _assemble(steps: list[Instruction]) -> tuple[Instruction, ...]:
    """Resolve _ACCEPT and _DROP into relative jumps to the two returns appended."""
    targets = {_ACCEPT: len(steps), _DROP: len(steps) + 1}

    def jump(index: int, target: int) -> int:
        return 0 if target == _NEXT else targets[target] - index - 1

    program = [(code, jump(i, jt), jump(i, jf), k) for i, (code, jt, jf, k) in enumerate(steps)]
    return (*program, (_RET_K, 0, 0, _KEEP_WHOLE), (_RET_K, 0, 0, 0))


def proc_event_filter(
    byteorder: Literal["little", "big"] = sys.byteorder,
) -> tuple[Instruction, ...]:
    """Keeps a datagram of one proc event when it is an exec or an exit with pid == tgid,
    drops other events, and keeps whole what it cannot judge (fail closed: dropping an
    exec or exit costs enforcement, reading noise a little CPU): too short, not
    NLMSG_DONE, another connector channel, or more than one message. BPF loads are
    big-endian and netlink is host order, so constants are compared as ``_as_loaded``
    sees them."""

    def loaded(value: int, size: int = 4) -> int:
        return _as_loaded(value, size, byteorder)

    steps: list[Instruction] = [
        (_LD_W_LEN, _NEXT, _NEXT, 0),
        (_JGE_K, _NEXT, _ACCEPT, _EVENT_BYTES),  # every load below is within the datagram
        *_load_host_word(0, byteorder),  # nlmsg_len, aligned (NLMSG_ALIGN) into X
        (_ALU_ADD_K, _NEXT, _NEXT, 3),
        (_ALU_AND_K, _NEXT, _NEXT, 0xFFFFFFFC),
        (_TAX, _NEXT, _NEXT, 0),
        (_LD_W_LEN, _NEXT, _NEXT, 0),
        (_JGT_X, _ACCEPT, _NEXT, 0),  # another message follows the first
        (_LD_H_ABS, _NEXT, _NEXT, 4),  # nlmsg_type
        (_JEQ_K, _NEXT, _ACCEPT, loaded(NLMSG_DONE, 2)),
        (_LD_W_ABS, _NEXT, _NEXT, _NLMSGHDR.size),  # cn_msg.idx
        (_JEQ_K, _NEXT, _ACCEPT, loaded(CN_IDX_PROC)),
        (_LD_W_ABS, _NEXT, _NEXT, _NLMSGHDR.size + 4),  # cn_msg.val
        (_JEQ_K, _NEXT, _ACCEPT, loaded(CN_VAL_PROC)),
        (_LD_W_ABS, _NEXT, _NEXT, _EVENT_OFFSET),  # proc_event.what
        (_JEQ_K, _ACCEPT, _NEXT, loaded(PROC_EVENT_EXEC)),
        (_JEQ_K, _NEXT, _DROP, loaded(PROC_EVENT_EXIT)),
        (_LD_W_ABS, _NEXT, _NEXT, _PIDS_OFFSET),  # pid == tgid survives the byte swap
        (_TAX, _NEXT, _NEXT, 0),
        (_LD_W_ABS, _NEXT, _NEXT, _PIDS_OFFSET + 4),
        (_JEQ_X, _ACCEPT, _DROP, 0),  # a thread's exit is not the process's
    ]
    return _assemble(steps)


PROC_EVENT_FILTER = proc_event_filter()


def _attach_filter(sock: socket.socket, program: Sequence[Instruction]) -> None:
    code = array.array("B", b"".join(_SOCK_FILTER.pack(*step) for step in program))
    fprog = _SOCK_FPROG.pack(len(program), code.buffer_info()[0])
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


def _filter_or_warn(sock: socket.socket, program: Sequence[Instruction] | None) -> bool:
    """Whether the kernel filters the socket; a refusal is one warning, never an error."""
    if program is None:
        return False
    try:
        _attach_filter(sock, program)
    except OSError as e:
        log.warning(
            "cannot attach the socket filter to the netlink process connector (%s): every "
            "process event on the node is read and dropped by the watchdog instead (more "
            "idle CPU, same enforcement); check that no seccomp policy refuses "
            "SO_ATTACH_FILTER",
            e.strerror or e,
        )
        return False
    return True


def _control_message(operation: int) -> bytes:
    payload = struct.pack("=I", operation)
    cn = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(payload), 0) + payload
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(cn), NLMSG_DONE, 0, 0, 0) + cn


class ProcEvents:
    """``filter_program`` is attached before the socket joins the group; where the kernel
    refuses it (an old kernel, a seccomp policy) one warning is logged and the reader goes
    on unfiltered: the filter saves CPU, it never costs enforcement."""

    def __init__(self, filter_program: Sequence[Instruction] | None = PROC_EVENT_FILTER) -> None:
        self.datagrams_read = 0
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
        except OSError as e:
            raise self._unavailable(e) from e
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER_BYTES)
            self.filtered = _filter_or_warn(sock, filter_program)
            sock.bind((0, CN_IDX_PROC))
            sock.send(_control_message(PROC_CN_MCAST_LISTEN))
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            raise self._unavailable(e) from e
        self._socket = sock
        self._wake = WakePipe()
        self._close_lock = threading.Lock()
        self._closed = False

    @staticmethod
    def _unavailable(error: OSError) -> ProcEventsUnavailable:
        return ProcEventsUnavailable(
            f"cannot listen to the netlink process connector ({error.strerror or error}); it "
            "needs root (CAP_NET_ADMIN) and a kernel with CONFIG_PROC_EVENTS"
        )

    def wake(self) -> None:
        self._wake.wake()

    def read(self, timeout_seconds: float) -> Events:
        events = Events()
        wake = self._wake.fileno()
        ready, _, _ = select.select([self._socket.fileno(), wake], [], [], timeout_seconds)
        if wake in ready:
            self._wake.drain()
            return events
        if not ready:
            return events
        # A bounded batch: select() is asked again only once the socket is empty.
        for _ in range(_MAX_DATAGRAMS_PER_READ):
            try:
                data = self._socket.recv(_DATAGRAM_BYTES)
            except BlockingIOError:
                break
            except OSError:  # ENOBUFS: the kernel dropped events; the caller rescans
                events.lost = True
                break
            self.datagrams_read += 1
            execs, exits = parse_datagram(data)
            events.execs |= execs
            events.exits |= exits
        return events

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            try:  # tell the kernel we stop listening; no answer is awaited
                self._socket.send(_control_message(PROC_CN_MCAST_IGNORE))
            except OSError:
                pass
            self._socket.close()
            self._wake.close()
