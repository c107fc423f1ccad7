"""What is mounted where (/proc/self/mountinfo), and mount(8)/umount(8) run with a timeout.

Mounts are made with util-linux's ``mount`` as an admin would type it, so each shows
in one line of the log. Whether a path is a mount point comes from mountinfo:
``os.path.ismount`` does not see a directory bind-mounted on itself (same device as
its parent).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

MOUNTINFO = "/proc/self/mountinfo"
MOUNTINFO_MAX_BYTES = 64 * 1024 * 1024  # a node with a million mounts has bigger problems
COMMAND_TIMEOUT_SECONDS = 30.0


class MountError(Exception):
    """mount(8) or umount(8) failed, or mountinfo could not be read; the message says which."""


@dataclass(frozen=True)
class MountEntry:
    mount_point: str
    fstype: str
    propagation: frozenset[str]  # the optional fields: "shared:N", "master:N", ...
    options: str  # the super block's options (size=..., nr_inodes=..., mode=...)


def parse_mountinfo(data: bytes) -> list[MountEntry]:
    """The lines of mountinfo in order (a later mount on the same point is on top);
    malformed lines skipped."""
    entries = []
    for raw in data.split(b"\n"):
        fields = raw.split(b" ")
        if len(fields) < 10 or b"-" not in fields[6:]:
            continue
        separator = fields.index(b"-", 6)
        if len(fields) < separator + 4:
            continue
        entries.append(
            MountEntry(
                _unescape(fields[4]),
                _unescape(fields[separator + 1]),
                frozenset(f.decode("utf-8", "replace") for f in fields[6:separator]),
                _unescape(fields[separator + 3]),
            )
        )
    return entries


def _unescape(field: bytes) -> str:
    """mountinfo writes space, tab, newline and backslash in a path as \\ooo (octal)."""
    out = bytearray()
    i = 0
    while i < len(field):
        if field[i : i + 1] == b"\\" and field[i + 1 : i + 4].isdigit() and i + 4 <= len(field):
            out.append(int(field[i + 1 : i + 4], 8) & 0xFF)
            i += 4
        else:
            out.append(field[i])
            i += 1
    return bytes(out).decode("utf-8", "surrogateescape")


def top_mount(path: str, mountinfo: str = MOUNTINFO) -> MountEntry | None:
    """The mount on top at exactly ``path`` (absolute, normal); None for none."""
    try:
        with open(mountinfo, "rb") as f:
            data = f.read(MOUNTINFO_MAX_BYTES + 1)
    except OSError as e:
        raise MountError(f"cannot read {mountinfo}: {e.strerror or e}") from e
    if len(data) > MOUNTINFO_MAX_BYTES:
        raise MountError(f"{mountinfo} is over {MOUNTINFO_MAX_BYTES} bytes")
    found = None
    for entry in parse_mountinfo(data):
        if entry.mount_point == path:
            found = entry
    return found


def run(argv: list[str], timeout_seconds: float = COMMAND_TIMEOUT_SECONDS) -> None:
    """Run mount(8) or umount(8); MountError with what it said when it fails."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_seconds)
    except FileNotFoundError as e:
        raise MountError(f"{argv[0]} not found: install util-linux") from e
    except subprocess.TimeoutExpired as e:
        raise MountError(f"{' '.join(argv)} did not finish in {timeout_seconds:g} s") from e
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
        raise MountError(f"{' '.join(argv)} failed: {said}")
