"""Process creation and exit from the kernel's netlink process connector.

The only module that imports pyroute2. ``ProcEvents.read()`` blocks until
the kernel reports something (or ``timeout_seconds`` pass) and returns the
PIDs that exec'd and the PIDs that exited since the last call. The
connector needs CAP_NET_ADMIN and a kernel built with CONFIG_PROC_EVENTS;
where it is missing ``open_proc_events`` says why and the watchdog relies on
its periodic scan alone.
"""

from __future__ import annotations

import select
from dataclasses import dataclass, field

from pyroute2.netlink.connector.cn_proc import ProcEventSocket


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

    def read(self, timeout_seconds: float) -> Events:
        events = Events()
        ready, _, _ = select.select([self._socket], [], [], timeout_seconds)
        if not ready:
            return events
        try:
            messages = self._socket.get()
        except OSError:  # ENOBUFS: the kernel dropped events
            events.lost = True
            return events
        for message in messages:
            kind = message.get("event")
            if kind == "PROC_EVENT_EXEC":
                events.execs.add(message.get("process_tgid"))
            elif kind == "PROC_EVENT_EXIT":
                if message.get("process_pid") == message.get("process_tgid"):
                    events.exits.add(message.get("process_tgid"))
        return events

    def close(self) -> None:
        try:
            self._socket.control(listen=False)
        except OSError:
            pass
        self._socket.close()
