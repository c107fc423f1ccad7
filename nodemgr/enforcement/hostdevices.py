"""What the host says of NVIDIA's device nodes, for the spec check at a container's creation.

A node is what its type and numbers say: ``c 1:1`` named ``/dev/nvidia-uvm`` is
``/dev/mem``. nvidia-uvm's and nvidia-caps' majors are chosen when the module loads, so
only the host can say them, and they are read at each check (the module may load on
first use). ``host_node`` is what a node named as NVIDIA's is compared with
(:mod:`nodemgr.domain.speccheck`).
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
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES)
    except OSError as e:
        raise HostDevicesError(f"{path}: {e.strerror}") from None
    return parse_nvidia_majors(data.decode("ascii", "replace"))


def host_node(path: str) -> HostNode | None:
    """Type ``-``: no device node; None where the host has nothing there."""
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
