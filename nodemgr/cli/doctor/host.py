"""How doctor looks at the node: its file tree under a root, and its unix sockets.

Every system location (/etc, /usr/share, /sys, /proc and the paths named in
the runtime's hook files) is resolved under ``Host.root``, so tests build a
fake node in a temporary directory. Paths named in gpushare-node's config are
used as they are: the config is the admin's statement of where things are.

``probe_socket`` connects to a unix stream socket and closes at once; its
``SocketProbe`` says what it found. ``stat_socket`` and ``connect_error`` are
the two halves every socket probe shares (the daemon's probes in
``daemon.py`` speak a protocol after connecting).
"""

from __future__ import annotations

import os
import socket
import stat
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    """Where the node's system files are (tests: a fake tree) and how long to wait."""

    root: str = "/"
    search_path: str | None = None  # $PATH for mps.control_binary; None = this process's
    timeout_seconds: float = 1.0  # per socket probe

    def path(self, absolute: str) -> str:
        return os.path.join(self.root, absolute.lstrip("/"))


@dataclass(frozen=True)
class SocketProbe:
    """What connecting to a unix socket found.

    ``state``: ok, no_dir (its directory is missing), missing, not_socket,
    refused (a stale socket: nobody listens), denied, timeout, bad_answer
    (connected, but the answer was not the protocol's), error.
    """

    state: str
    error: str = ""


def probe_socket(path: str, timeout: float) -> SocketProbe:
    """Connect to a unix stream socket and close at once."""
    found = stat_socket(path)
    if found is not None:
        return found
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as e:
            return connect_error(e)
    return SocketProbe("ok")


def stat_socket(path: str) -> SocketProbe | None:
    """The probe's answer when there is no socket to connect to, else None."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return SocketProbe("missing" if os.path.isdir(os.path.dirname(path)) else "no_dir")
    except PermissionError as e:
        return SocketProbe("denied", e.strerror or str(e))
    except OSError as e:
        return SocketProbe("error", e.strerror or str(e))
    return None if stat.S_ISSOCK(mode) else SocketProbe("not_socket")


def connect_error(e: OSError) -> SocketProbe:
    """The probe's answer when connecting (or talking) to the socket raised ``e``."""
    if isinstance(e, ConnectionRefusedError):
        return SocketProbe("refused")
    if isinstance(e, PermissionError):
        return SocketProbe("denied", e.strerror or str(e))
    if isinstance(e, TimeoutError):
        return SocketProbe("timeout")
    return SocketProbe("error", e.strerror or str(e))
