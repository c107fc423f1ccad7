"""Registrations written onto the containers' own cgroups, so they outlive a lost ledger.

A registration is also written as the ``trusted.gpushare.registration`` extended
attribute of the container's cgroup directory. ``trusted.*`` needs CAP_SYS_ADMIN in the
host's user namespace, which no ordinary container holds, so a container cannot forge
its mark, and the mark goes with the cgroup. After a lost ledger the next start reads
them back (nodemgr.allocation.recovery). A mark is believed only where it stands: in
the container's own cgroup that it names, with its init process still running with the
same start time; anything else is skipped with a warning.

What it must not do: decide whether a container may use a GPU (the registry does).
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from nodemgr.domain.containercheck import is_container_cgroup
from nodemgr.domain.model import CgroupKey, ContainerRef, Registration
from nodemgr.enforcement import procfs

log = logging.getLogger(__name__)

MARK_XATTR = "trusted.gpushare.registration"
MARK_VERSION = 1
MAX_MARK_BYTES = 4096
# Per hierarchy walk; a node has a few thousand.
MAX_WALKED_DIRECTORIES = 200_000
# As in containercheck.
HIERARCHIES = ("", "memory", "pids")


class MarkError(ValueError):
    """A mark that is not a registration this daemon wrote."""


def encode_mark(registration: Registration) -> bytes:
    identity = registration.identity
    document = {
        "v": MARK_VERSION,
        "container_id": registration.container_id,
        "allocation_id": registration.allocation_id,
        "hierarchy": registration.cgroup.hierarchy,
        "path": registration.cgroup.path,
        "init_pid": registration.init_pid,
        "init_start_ticks": registration.init_start_ticks,
        "identity": [identity.namespace, identity.pod, identity.container] if identity else None,
        "registered_at": registration.registered_at,
    }
    return json.dumps(document, separators=(",", ":")).encode()


def decode_mark(data: bytes) -> Registration:
    if len(data) > MAX_MARK_BYTES:
        raise MarkError(f"over {MAX_MARK_BYTES} bytes")
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise MarkError(f"not JSON ({e})") from None
    if not isinstance(document, dict) or document.get("v") != MARK_VERSION:
        raise MarkError(f"not a version {MARK_VERSION} mark")
    try:
        identity = document["identity"]
        registration = Registration(
            container_id=_text(document["container_id"]),
            allocation_id=_text(document["allocation_id"]),
            cgroup=CgroupKey(_text(document["hierarchy"], empty=True), _text(document["path"])),
            init_pid=_count(document["init_pid"]),
            init_start_ticks=_count(document["init_start_ticks"]),
            identity=ContainerRef(*(_text(part) for part in identity))
            if identity is not None
            else None,
            registered_at=float(document["registered_at"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise MarkError(f"malformed ({e})") from None
    return registration


def _text(value: object, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty):
        raise ValueError(f"{value!r} is not a non-empty string")
    return value


def _count(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{value!r} is not a positive integer")
    return value


def cgroup_mounts(mountinfo: str) -> dict[str, str]:
    """Hierarchy -> where its root is mounted (a container's view of its cgroup, root
    field not ``/``, is not where the host's paths start)."""
    mounts: dict[str, str] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 10:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) < 3 or fields[3] != "/":
            continue
        fstype, options = after[0], after[2].split(",")
        mountpoint = fields[4].replace("\\040", " ")
        if fstype == "cgroup2":
            mounts.setdefault("", mountpoint)
        elif fstype == "cgroup":
            controllers = [o for o in options if o in HIERARCHIES or o.startswith("name=")]
            for controller in controllers:
                if controller in HIERARCHIES:
                    mounts.setdefault(controller, mountpoint)
    return mounts


@dataclass
class CgroupMarks:
    mounts: dict[str, str]

    @classmethod
    def of_this_host(cls) -> CgroupMarks:
        try:
            with open("/proc/self/mountinfo") as f:
                return cls(cgroup_mounts(f.read()))
        except OSError as e:
            log.warning("cannot read /proc/self/mountinfo (%s): no cgroup marks", e)
            return cls({})

    def directory(self, cgroup: CgroupKey) -> str | None:
        root = self.mounts.get(cgroup.hierarchy)
        if root is None:
            return None
        return os.path.join(root, cgroup.path.lstrip("/"))

    def write(self, registration: Registration) -> str | None:
        """Why it could not be marked, or None."""
        directory = self.directory(registration.cgroup)
        if directory is None:
            hierarchy = registration.cgroup.hierarchy or "unified"
            return f"the {hierarchy} cgroup hierarchy is not mounted here"
        try:
            os.setxattr(directory, MARK_XATTR, encode_mark(registration))
        except OSError as e:
            return f"cannot set {MARK_XATTR} on {directory}: {e.strerror or e}"
        return None

    def read_all(self) -> list[Registration]:
        found: dict[str, Registration] = {}
        for hierarchy in HIERARCHIES:
            root = self.mounts.get(hierarchy)
            if root is None:
                continue
            for directory in _directories(root):
                registration = self._read_one(hierarchy, root, directory)
                if registration is not None:
                    found.setdefault(registration.container_id, registration)
        return sorted(found.values(), key=lambda r: (r.registered_at, r.container_id))

    def _read_one(self, hierarchy: str, root: str, directory: str) -> Registration | None:
        try:
            data = os.getxattr(directory, MARK_XATTR)
        except OSError as e:
            if e.errno not in (errno.ENODATA, errno.ENOENT, errno.EOPNOTSUPP):
                log.warning("cannot read the mark of %s: %s", directory, e.strerror or e)
            return None
        try:
            registration = decode_mark(data)
        except MarkError as e:
            log.warning("the mark on %s is not believed: %s", directory, e)
            return None
        path = "/" + os.path.relpath(directory, root)
        problem = _standing_problem(registration, hierarchy, path)
        if problem is not None:
            log.warning("the mark on %s is not believed: %s", directory, problem)
            return None
        return registration


def _standing_problem(registration: Registration, hierarchy: str, path: str) -> str | None:
    if registration.cgroup != CgroupKey(hierarchy, path):
        return f"it names cgroup {registration.cgroup}, not this one"
    if not is_container_cgroup(path, registration.container_id):
        return f"this is not the cgroup of container {registration.container_id}"
    try:
        ticks = procfs.read_start_ticks(registration.init_pid)
    except procfs.ProcfsError as e:
        return f"its init process {registration.init_pid} cannot be read ({e})"
    if ticks != registration.init_start_ticks:
        return f"its init process {registration.init_pid} is gone"
    return None


def _directories(root: str) -> Iterator[str]:
    """Not following links, at most MAX_WALKED_DIRECTORIES."""
    walked = 0
    for directory, _subdirs, _files in os.walk(root, followlinks=False):
        walked += 1
        if walked > MAX_WALKED_DIRECTORIES:
            log.warning("stopped reading cgroup marks under %s after %d directories", root, walked)
            return
        yield directory
