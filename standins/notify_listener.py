"""Plays systemd's side of the notify protocol: a bound AF_UNIX datagram socket.

A path socket or an abstract one (``@name``), as systemd may hand either in
``$NOTIFY_SOCKET``; ``messages`` returns each datagram as a dict of its lines.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time


class Listener:
    """Plays systemd's side: a bound datagram socket."""

    def __init__(self, abstract: bool = False):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"gpushare-test-{os.getpid()}-{time.monotonic_ns()}"
            self.sock.bind("\0" + name)
            self.address = "@" + name
        else:
            self.dir = tempfile.mkdtemp(prefix="gs-notify-", dir="/tmp")
            self.address = os.path.join(self.dir, "notify.sock")
            self.sock.bind(self.address)
        self.sock.settimeout(2)

    def messages(self, wait: float = 0.2) -> list[dict[str, str]]:
        found = []
        self.sock.settimeout(wait)
        while True:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                return found
            found.append(dict(line.split("=", 1) for line in data.decode().split("\n")))

    def close(self):
        self.sock.close()
