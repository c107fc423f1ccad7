"""What the host says of NVIDIA's device nodes, for the spec check at a container's creation.

A device node is what its type and numbers say, whatever it is called: ``c 1:1`` named
``/dev/nvidia-uvm`` is ``/dev/mem``. The numbers of NVIDIA's own nodes are partly chosen when
a driver module loads (nvidia-uvm, nvidia-caps: a major from the kernel's dynamic range), so
only the host can say them: ``nvidia_majors`` reads them from /proc/devices (the module may be
loaded on first use, so it is read at each check, not once), and ``host_node`` stats the
host's node of a name, to which a node named as NVIDIA's but made with other numbers is
compared (:mod:`nodemgr.domain.speccheck`).
"""

from __future__ import annotations

import os
import stat

from hooks.specfacts import nvidia_majors as parse_nvidia_majors
from nodemgr.domain.speccheck import HostNode

PROC_DEVICES = "/proc/devices"
MAX_BYTES = 128 * 1024  # a line per driver; /proc/devices is a few KiB


class HostDevicesError(Exception):
    """/proc/devices cannot be read; the message says why."""


def nvidia_majors(path: str = PROC_DEVICES) -> frozenset[int]:
    """The char majors of NVIDIA's drivers besides 195 (nvidia-uvm's, nvidia-caps', ...)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES)
    except OSError as e:
        raise HostDevicesError(f"{path}: {e.strerror}") from None
    return parse_nvidia_majors(data.decode("ascii", "replace"))


def host_node(path: str) -> HostNode | None:
    """The host's node at ``path`` (its type and numbers; a file that is no device node has
    type ``-``); None where the host has nothing there."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    if stat.S_ISCHR(info.st_mode):
        kind = "c"
    elif stat.S_ISBLK(info.st_mode):
        kind = "b"
    else:
        return HostNode("-", 0, 0)
    return HostNode(kind, os.major(info.st_rdev), os.minor(info.st_rdev))
