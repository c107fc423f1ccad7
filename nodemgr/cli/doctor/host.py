"""How doctor looks at the node: its file tree under a root, and its unix sockets.

System locations are resolved under ``Host.root``, so tests build a fake node in a
temporary directory; paths in gpushare-node's config are used as they are (the admin's
statement of where things are).
"""

from __future__ import annotations

import os
import socket
import stat
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    root: str = "/"
    search_path: str | None = None  # $PATH for mps.control_binary; None = this process's
    timeout_seconds: float = 1.0  # per socket probe

    def path(self, absolute: str) -> str:
        return os.path.join(self.root, absolute.lstrip("/"))


@dataclass(frozen=True)
class SocketProbe:
    """``state``: ok, no_dir, missing, not_socket, refused (a stale socket), denied,
    timeout, bad_answer (not the protocol's), error."""

    state: str
    error: str = ""


def probe_socket(path: str, timeout: float) -> SocketProbe:
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
    if isinstance(e, ConnectionRefusedError):
        return SocketProbe("refused")
    if isinstance(e, PermissionError):
        return SocketProbe("denied", e.strerror or str(e))
    if isinstance(e, TimeoutError):
        return SocketProbe("timeout")
    return SocketProbe("error", e.strerror or str(e))
