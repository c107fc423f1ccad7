"""The systemd service protocol: READY, STATUS, RELOADING, STOPPING and watchdog pings.

A datagram of ``KEY=VALUE`` lines to ``$NOTIFY_SOCKET``, spoken directly: the
``sdnotify`` package (0.3.2) reads ``$NOTIFY_SOCKET`` from the process environment
itself (tests could not point it elsewhere), encodes Latin-1 and hides the failure in a
bare ``except`` (a STATUS naming a non-Latin-1 pod would vanish; systemd reads UTF-8),
and knows nothing of ``$WATCHDOG_USEC`` / ``$WATCHDOG_PID``. Without ``$NOTIFY_SOCKET``
every call does nothing. A failed send is logged once and never raised: systemd being
gone must not stop the device plugin.

``$WATCHDOG_USEC`` is honoured only when ``$WATCHDOG_PID`` is unset or is our
PID (sd_watchdog_enabled(3)); pings are then due every half interval. What
it must not do: decide whether the daemon is healthy (the run loop does, and
pings only from a healthy iteration).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

_STATUS_MAX_CHARS = 200  # systemctl status shows one line


class ServiceNotifier:
    def __init__(self, environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        self.socket_path = environ.get("NOTIFY_SOCKET", "")
        self.watchdog_interval_seconds = _watchdog_interval(environ)
        self._socket: socket.socket | None = None
        self._failed = False
        self._last_ping = 0.0  # monotonic
        self._last_status = ""
        if self.socket_path:
            # "@name" is an abstract-namespace socket: a leading NUL byte instead of "@".
            address = self.socket_path
            if address.startswith("@"):
                address = "\0" + address[1:]
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            try:
                sock.connect(address)
                self._socket = sock
            except OSError as e:
                sock.close()
                log.warning("cannot reach systemd at NOTIFY_SOCKET=%s: %s", self.socket_path, e)

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def ready(self, status: str) -> None:
        self._send("READY=1", f"STATUS={_one_line(status)}")
        self._last_status = status

    def reloading(self) -> None:
        monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self._send("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec}", "STATUS=reloading")
        self._last_status = "reloading"

    def stopping(self) -> None:
        self._send("STOPPING=1", "STATUS=stopping")

    def status(self, status: str) -> None:
        """Sent only when it changed."""
        if status != self._last_status:
            self._send(f"STATUS={_one_line(status)}")
            self._last_status = status

    def watchdog(self) -> None:
        """When one is due; call it only from a healthy iteration."""
        if self.watchdog_interval_seconds is None:
            return
        now = time.monotonic()
        if now - self._last_ping >= self.watchdog_interval_seconds / 2:
            self._send("WATCHDOG=1")
            self._last_ping = now

    def _send(self, *lines: str) -> None:
        if self._socket is None:
            return
        try:
            self._socket.send("\n".join(lines).encode())
            self._failed = False
        except OSError as e:
            if not self._failed:  # once per outage, not at every ping
                log.warning("cannot notify systemd at %s: %s", self.socket_path, e)
                self._failed = True


def _watchdog_interval(environ: Mapping[str, str]) -> float | None:
    usec, pid = environ.get("WATCHDOG_USEC", ""), environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None  # meant for another process (e.g. our parent's)
    return int(usec) / 1_000_000


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _STATUS_MAX_CHARS else line[: _STATUS_MAX_CHARS - 3] + "..."
