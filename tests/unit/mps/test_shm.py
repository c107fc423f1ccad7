"""Pins mps.shm: a card's tmpfs is mounted with its size, one inode per 4 KiB, nosuid,
nodev and mode 1777, resized in place (the same file system) when the size changes, and
refused over a mount that is not a tmpfs; emptying removes whatever a tenant left
(files, links, deep trees) without following a link out of the tmpfs, and keeps the
directory itself. Real tmpfs mounts need root; emptying runs on any directory."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from mps import mounts, shm
from standins.daemon_proc import unmount_under

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def scratch():
    path = tempfile.mkdtemp(prefix="shm-", dir="/tmp")
    yield path
    unmount_under(path)
    shutil.rmtree(path, ignore_errors=True)


@needs_root
def test_a_tmpfs_is_mounted_with_size_inodes_and_options(scratch):
    """16 MiB, 4096 inodes (one per 4 KiB), mode 1777, nosuid and nodev."""
    path = f"{scratch}/shm"
    assert shm.mount(path, 16) == "mounted"
    assert shm.sized(path) == (16 * 2**20, 4096)
    top = mounts.top_mount(path)
    assert top is not None and top.fstype == "tmpfs"
    assert os.stat(path).st_mode & 0o7777 == 0o1777
    flags = os.statvfs(path).f_flag
    assert flags & os.ST_NOSUID and flags & os.ST_NODEV
    assert shm.mount(path, 16) == "kept"


@needs_root
def test_a_new_size_resizes_the_same_file_system(scratch):
    """A file written before the resize is still there after it: the tmpfs that
    containers and the MPS daemon hold is the one resized, not a new one on top."""
    path = f"{scratch}/shm"
    shm.mount(path, 16)
    device = shm.device(path)
    with open(f"{path}/kept", "w") as f:
        f.write("x")
    assert shm.mount(path, 32) == "resized"
    assert shm.sized(path) == (32 * 2**20, 8192)
    assert shm.device(path) == device and os.path.exists(f"{path}/kept")


@needs_root
def test_the_size_is_enforced(scratch):
    """Writing past the size fails with ENOSPC."""
    path = f"{scratch}/shm"
    shm.mount(path, 1)
    with pytest.raises(OSError, match="No space left on device"):
        fill(f"{path}/fill", 2 * 2**20)
    assert os.path.getsize(f"{path}/fill") <= 2**20


def fill(path: str, size: int) -> None:
    """Write ``size`` bytes to ``path``, 64 KiB at a time."""
    with open(path, "wb", buffering=0) as f:
        for _ in range(size // 65536):
            f.write(b"\0" * 65536)


@needs_root
def test_another_file_system_mounted_there_is_refused(scratch):
    """A bind mount (not a tmpfs) at the path: refused, naming it."""
    path = f"{scratch}/shm"
    os.makedirs(path)
    mounts.run(["mount", "--bind", scratch, path])
    with pytest.raises(mounts.MountError, match="not a tmpfs"):
        shm.mount(path, 16)


@needs_root
def test_unmount_detaches_and_says_whether_there_was_one(scratch):
    path = f"{scratch}/shm"
    shm.mount(path, 16)
    assert shm.unmount(path) is True
    assert mounts.top_mount(path) is None
    assert shm.unmount(path) is False


def test_emptying_removes_files_links_and_trees_and_keeps_the_directory(tmp_path):
    """Files, a symbolic link to a directory outside (removed as a link: what it points to
    stays whole), nested and hidden entries: all gone, the directory kept."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    shm_dir = tmp_path / "shm"
    (shm_dir / "a" / "b" / "c").mkdir(parents=True)
    (shm_dir / "a" / "b" / "c" / "f").write_text("x")
    (shm_dir / "torch_1_secret").write_text("y")
    (shm_dir / ".hidden").write_text("z")
    (shm_dir / "a" / "out").symlink_to(outside)
    (shm_dir / "link").symlink_to(outside)
    emptied = shm.empty(str(shm_dir))
    assert emptied == shm.Emptied(removed=emptied.removed, left=0) and emptied.removed >= 7
    assert os.listdir(shm_dir) == []
    assert (outside / "precious").read_text() == "keep"


def test_a_tree_deeper_than_the_recursion_limit_is_emptied(tmp_path):
    """A tenant's 3,000-deep directory chain (past Python's recursion limit and any
    sensible count of open descriptors) goes too."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    fd = os.open(shm_dir, os.O_RDONLY)
    for _ in range(3000):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    assert shm.empty(str(shm_dir)).left == 0
    assert os.listdir(shm_dir) == []


def test_emptying_stops_at_its_deadline(tmp_path):
    """A deadline already passed removes nothing and says what is left."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    for i in range(3):
        (shm_dir / str(i)).write_text("x")
    assert shm.empty(str(shm_dir), deadline_seconds=0) == shm.Emptied(0, 3)


def test_a_link_in_place_of_the_directory_is_not_followed(tmp_path):
    """The path itself a symbolic link: refused (OSError), nothing behind it removed."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "f").write_text("x")
    (tmp_path / "shm").symlink_to(target)
    with pytest.raises(OSError, match="Too many levels of symbolic links|Not a directory"):
        shm.empty(str(tmp_path / "shm"))
    assert os.listdir(target) == ["f"]


def test_inodes_follow_the_size():
    """One inode per 4 KiB, never fewer than 1024."""
    assert shm.inodes_for(64) == 16384
    assert shm.inodes_for(1) == 1024
