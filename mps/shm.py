"""A card's /dev/shm: one tmpfs per card, its size, and emptying it.

Whoever shares a /dev/shm reads, overwrites, deletes and crowds out the others' files
(PyTorch's data loaders pass tensors through them). Each card gets a tmpfs at
``<run_dir>/mps/<card UUID>/shm``: the /dev/shm of its control daemon and MPS servers
(mps.namespace), and no one else's. No container gets it: an MPS client passes nothing
to its server through /dev/shm (measured on driver 580, docs/gpu-tests.md), so each
keeps the /dev/shm its runtime gives it, and the spec check refuses one that mounts a
card's tmpfs. Whatever a driver may put there stays off the host's /dev/shm.

It is mounted ``nosuid,nodev,mode=1777`` (as the host's /dev/shm) with at most one inode
per 4 KiB (``nr_inodes``): an inode costs kernel memory the size does not count, so
empty files would otherwise take it without bound. A later start remounts it to resize,
so a running daemon and its servers keep the same file system.

Emptying (once the card holds no shared allocation) follows nothing (directories opened
O_NOFOLLOW relative to their parent, links removed as links) and takes a tree of any
depth apart with two descriptors open, by moving a non-empty directory's entries up into
the root.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

from mps import mounts
from mps.mounts import MountError

BYTES_PER_INODE = 4096
MIN_INODES = 1024
TMPFS = "tmpfs"
# Name (plus a number) of entries moved up while emptying; a tenant's file of that name
# is replaced, which emptying does to it anyway.
HOISTED = ".gpushare-emptying-"


@dataclass(frozen=True)
class Emptied:
    removed: int  # files, links and directories removed
    left: int  # entries still in the root when it stopped (0: empty)


def inodes_for(size_mib: int) -> int:
    return max(MIN_INODES, size_mib * 1024 * 1024 // BYTES_PER_INODE)


def mount(path: str, size_mib: int) -> str:
    """A tmpfs of ``size_mib`` at ``path``; says what was done ("mounted", "resized",
    "kept") for the log. MountError when it cannot be had."""
    os.makedirs(path, mode=0o755, exist_ok=True)
    options = f"size={size_mib}m,nr_inodes={inodes_for(size_mib)}"
    top = mounts.top_mount(os.path.abspath(path))
    if top is not None and top.fstype == TMPFS:
        if sized(path) == (size_mib * 1024 * 1024, inodes_for(size_mib)):
            return "kept"
        mounts.run(["mount", "-o", f"remount,{options}", path])
        return "resized"
    if top is not None:
        raise MountError(f"{path} is a mount of {top.fstype}, not a tmpfs: unmount it")
    mounts.run(["mount", "-t", TMPFS, "-o", f"{options},mode=1777,nosuid,nodev", TMPFS, path])
    return "mounted"


def sized(path: str) -> tuple[int, int]:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize, st.f_files


def is_tmpfs(path: str) -> bool:
    top = mounts.top_mount(os.path.abspath(path))
    return top is not None and top.fstype == TMPFS


def device(path: str) -> int | None:
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


def unmount(path: str) -> bool:
    """Detach whatever is mounted at ``path`` (lazily: holders keep it); False for none."""
    if mounts.top_mount(os.path.abspath(path)) is None:
        return False
    mounts.run(["umount", "--lazy", path])
    return True


def empty(path: str, deadline_seconds: float = 10.0) -> Emptied:
    """Remove everything under ``path``, not ``path`` itself, until nothing is left, a
    round makes no progress, or ``deadline_seconds`` pass."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    root = os.open(path, flags)
    removed = 0
    serials = itertools.count()
    deadline = time.monotonic() + deadline_seconds
    try:
        progress = True
        while progress and time.monotonic() < deadline:
            progress = False
            for name in os.listdir(root):
                gone = _remove(root, name)
                if gone:
                    removed += 1
                    progress = True
                    continue
                if gone is None:  # a directory with entries: bring them up to the root
                    progress = _hoist(root, name, flags, serials) > 0 or progress
                if time.monotonic() >= deadline:
                    break
        return Emptied(removed, len(os.listdir(root)))
    finally:
        os.close(root)


def _remove(root: int, name: str) -> bool | None:
    """True: gone (or vanished); None: a directory with entries; False: not removable."""
    try:
        os.unlink(name, dir_fd=root)
        return True
    except FileNotFoundError:
        return True
    except IsADirectoryError:
        pass
    except OSError as e:
        if e.errno != errno.EPERM:  # Linux answers EISDIR; EPERM is what POSIX allows
            return False
    try:
        os.rmdir(name, dir_fd=root)
        return True
    except FileNotFoundError:
        return True
    except OSError as e:
        return None if e.errno in (errno.ENOTEMPTY, errno.EEXIST) else False


def _hoist(root: int, name: str, flags: int, serials: Iterator[int]) -> int:
    """Move directory ``name``'s entries into the root under new names; how many moved."""
    try:
        directory = os.open(name, flags, dir_fd=root)
    except OSError:
        return 0
    moved = 0
    try:
        for child in os.listdir(directory):
            try:
                target = f"{HOISTED}{next(serials)}"
                os.rename(child, target, src_dir_fd=directory, dst_dir_fd=root)
                moved += 1
            except OSError:
                continue
    finally:
        os.close(directory)
    return moved
