"""Pins mps.mounts: mountinfo lines parsed as the kernel writes them (octal escapes in
paths, optional propagation fields, a later mount on top of an earlier one), lines not
as the kernel writes them skipped, and a failing mount(8) reported with what it said."""

import pytest

from mps import mounts

LINES = (
    b"22 27 0:21 / /proc rw,relatime - proc proc rw\n"
    b"48 27 0:39 / /run/a\\040b/shm rw,nosuid shared:5 - tmpfs tmpfs "
    b"rw,size=65536k,nr_inodes=16384\n"
    b"49 48 0:40 / /run/a\\040b/shm rw master:7 - tmpfs tmpfs rw,size=1024k\n"
    b"not a line at all\n"
    b"50 27 0:41 / /broken rw -\n"
)


def test_lines_are_parsed_with_escapes_and_propagation():
    """The path's \\040 is a space; optional fields are the propagation; the super block's
    options are kept; short or malformed lines are skipped."""
    entries = mounts.parse_mountinfo(LINES)
    assert [e.mount_point for e in entries] == ["/proc", "/run/a b/shm", "/run/a b/shm"]
    assert entries[1].propagation == frozenset({"shared:5"})
    assert entries[1].fstype == "tmpfs"
    assert entries[1].options == "rw,size=65536k,nr_inodes=16384"


def test_the_top_mount_is_the_last_one_at_that_point(tmp_path):
    """Two mounts at one point: the later one is on top; nothing mounted there is None."""
    path = tmp_path / "mountinfo"
    path.write_bytes(LINES)
    top = mounts.top_mount("/run/a b/shm", str(path))
    assert top is not None and top.options == "rw,size=1024k"
    assert mounts.top_mount("/run", str(path)) is None


def test_an_unreadable_mountinfo_is_an_error(tmp_path):
    with pytest.raises(mounts.MountError, match="cannot read"):
        mounts.top_mount("/", str(tmp_path / "missing"))


def test_a_failing_command_says_what_it_said():
    """mount(8)'s own words come back in the error, with the command."""
    with pytest.raises(mounts.MountError, match=r"umount /nonexistent-gpushare failed: .+"):
        mounts.run(["umount", "/nonexistent-gpushare"])


def test_a_missing_command_names_util_linux():
    with pytest.raises(mounts.MountError, match="util-linux"):
        mounts.run(["/nonexistent/mount"])
