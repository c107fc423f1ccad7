"""Process creation and exit from the kernel's netlink process connector.

The only module that imports pyroute2. ``ProcEvents.read()`` blocks until
the kernel reports something (or ``timeout_seconds`` pass) and returns the
PIDs that exec'd and the PIDs that exited since the last call. The
connector needs CAP_NET_ADMIN and a kernel built with CONFIG_PROC_EVENTS;
where it is missing ``open_proc_events`` says why and the watchdog relies on
its periodic scan alone.
"""

from __future__ import annotations

import os
import select
import threading
from dataclasses import dataclass, field
from typing import Any

from pyroute2.netlink.connector.cn_proc import (
    CN_IDX_PROC,
    CN_VAL_PROC,
    NLMSG_DONE,
    PROC_CN_MCAST_IGNORE,
    ProcEventSocket,
    proc_event_control,
)

_DATAGRAM_BYTES = 1 << 16  # a netlink datagram is far smaller
_MAX_MESSAGES_PER_READ = 4096  # a fork storm is read in bounded batches


class ProcEventsUnavailable(Exception):
    pass


@dataclass
class Events:
    execs: set[int] = field(default_factory=set)  # thread group ids that called exec
    exits: set[int] = field(default_factory=set)  # processes (thread group leaders) gone
    lost: bool = False  # the kernel dropped events (socket buffer full): rescan


class ProcEvents:
    def __init__(self) -> None:
        try:
            self._socket = ProcEventSocket()
            self._socket.bind()
            self._socket.control(listen=True)
        except OSError as e:
            raise ProcEventsUnavailable(
                f"cannot listen to the netlink process connector ({e.strerror or e}); it needs "
                "root (CAP_NET_ADMIN) and a kernel with CONFIG_PROC_EVENTS"
            ) from e
        # wake() writes here so that a read blocked in select returns at once (a stop).
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # Held by wake() and close(): a closed descriptor's number may be reused by any
        # file, which a late wake() must never write into.
        self._wake_lock = threading.Lock()
        self._closed = False

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
        ready, _, _ = select.select([self._socket, self._wake_read], [], [], timeout_seconds)
        if self._wake_read in ready:
            try:
                os.read(self._wake_read, 4096)
            except OSError:
                pass
            return events
        if not ready:
            return events
        # Every datagram waiting is read here, straight from the descriptor, and parsed
        # with pyroute2's marshal: pyroute2's own get() drains the socket into a buffer
        # of its own and returns one message, so select() never saw the rest (exec and
        # exit events were lost).
        fd = self._socket.fileno()
        messages: list[Any] = []  # pyroute2 nlmsg objects
        while len(messages) < _MAX_MESSAGES_PER_READ:
            try:
                data = os.read(fd, _DATAGRAM_BYTES)
            except BlockingIOError:
                break
            except OSError:  # ENOBUFS: the kernel dropped events; the caller rescans
                events.lost = True
                break
            messages += self._socket.marshal.parse(data)
            if not select.select([fd], [], [], 0)[0]:
                break
        for message in messages:
            kind = message.get("event")
            if kind == "PROC_EVENT_EXEC":
                events.execs.add(message.get("process_tgid"))
            elif kind == "PROC_EVENT_EXIT":
                if message.get("process_pid") == message.get("process_tgid"):
                    events.exits.add(message.get("process_tgid"))
        return events

    def close(self) -> None:
        with self._wake_lock:
            if self._closed:
                return
            self._closed = True
            try:
                _send_ignore(self._socket)
            except OSError:
                pass
            self._socket.close()
            os.close(self._wake_read)
            os.close(self._wake_write)


def _send_ignore(sock: ProcEventSocket) -> None:
    """Tell the kernel we stop listening, without waiting for an answer.

    pyroute2's ``control(listen=False)`` sends the same message and then waits for
    any message to arrive; after an IGNORE on a quiet node none ever does, and the
    watchdog's stop hung there.
    """
    msg = proc_event_control()
    msg["action"] = PROC_CN_MCAST_IGNORE
    msg["idx"] = CN_IDX_PROC
    msg["val"] = CN_VAL_PROC
    msg["len"] = 4  # the payload: one 32-bit action
    sock.put(msg, NLMSG_DONE, msg_flags=0, msg_seq=0)
