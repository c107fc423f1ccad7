"""Pins the cgroup marks: a registration round-trips through its mark, a mark that is
malformed, moved to another cgroup, on a cgroup not named by its container ID or naming
a gone init process is not believed, the hierarchies are found in mountinfo, and a
process without CAP_SYS_ADMIN (what a container's root is) cannot write a mark."""

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from nodemgr.domain.model import CgroupKey, ContainerRef, Registration
from nodemgr.enforcement import procfs
from nodemgr.enforcement.cgroupmarks import (
    MARK_XATTR,
    CgroupMarks,
    MarkError,
    cgroup_mounts,
    decode_mark,
    encode_mark,
)

MOUNTINFO = """\
25 30 0:22 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs rw,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
27 25 0:24 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
28 25 0:25 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
29 25 0:26 / /sys/fs/cgroup/pids rw,nosuid - cgroup cgroup rw,pids
40 39 0:24 /kubepods/pod1 /inner/memory rw - cgroup cgroup rw,memory
"""


def registration(path="/kubepods/pod1/cid-1", hierarchy="memory", pid=None, ticks=None):
    pid = pid or os.getpid()
    return Registration(
        container_id="cid-1",
        allocation_id="ga-0123456789abcdef",
        cgroup=CgroupKey(hierarchy, path),
        init_pid=pid,
        init_start_ticks=ticks or procfs.read_start_ticks(pid),
        identity=ContainerRef("team-a", "trainer-0", "main"),
        registered_at=1234.5,
    )


def test_a_registration_round_trips_through_its_mark():
    """Every field of a registration comes back from its mark unchanged."""
    original = registration()
    assert decode_mark(encode_mark(original)) == original


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"\xff\xfe",
        b"[]",
        b'{"v": 2}',
        b'{"v": 1, "container_id": "c"}',
        b'{"v": 1, "container_id": "", "allocation_id": "a", "hierarchy": "", "path": "/x",'
        b' "init_pid": 1, "init_start_ticks": 1, "identity": null, "registered_at": 0}',
        b'{"v": 1, "container_id": "c", "allocation_id": "a", "hierarchy": "", "path": "/x",'
        b' "init_pid": true, "init_start_ticks": 1, "identity": null, "registered_at": 0}',
        b"x" * 5000,
    ],
)
def test_a_malformed_mark_is_refused(data):
    """Anything but a complete version-1 mark with sane fields is a MarkError."""
    with pytest.raises(MarkError):
        decode_mark(data)


def test_hierarchies_are_found_in_mountinfo_and_a_nested_view_is_not_a_root():
    """unified, memory and pids come from their mounts; a bind of a sub-cgroup elsewhere
    (root field not /) does not count, and hierarchies the marks do not use are left out."""
    assert cgroup_mounts(MOUNTINFO) == {
        "": "/sys/fs/cgroup/unified",
        "memory": "/sys/fs/cgroup/memory",
        "pids": "/sys/fs/cgroup/pids",
    }


@pytest.fixture
def real_cgroup():
    """A real container-named cgroup in this host's first mounted hierarchy of the three."""
    if os.geteuid() != 0:
        pytest.skip("writing trusted.* attributes needs root")
    marks = CgroupMarks.of_this_host()
    hierarchy = next((h for h in ("memory", "", "pids") if h in marks.mounts), None)
    if hierarchy is None:
        pytest.skip("no cgroup hierarchy mounted")
    parent = f"/gs-marks-{uuid.uuid4().hex[:8]}"
    path = f"{parent}/cid-1"
    directory = marks.directory(CgroupKey(hierarchy, path))
    os.makedirs(directory)
    yield marks, hierarchy, path, directory
    os.rmdir(directory)
    os.rmdir(os.path.dirname(directory))


def test_a_mark_written_on_a_real_cgroup_is_read_back(real_cgroup):
    """write() sets the trusted attribute on the container's cgroup directory and
    read_all() finds it by walking the hierarchy."""
    marks, hierarchy, path, directory = real_cgroup
    mine = registration(path, hierarchy)
    assert marks.write(mine) is None
    assert os.getxattr(directory, MARK_XATTR) == encode_mark(mine)
    assert mine in marks.read_all()


def test_a_mark_copied_to_another_cgroup_is_not_believed(real_cgroup, caplog):
    """A mark naming another cgroup than the directory it sits on (copied there by whoever
    could) is skipped with a warning."""
    marks, hierarchy, path, directory = real_cgroup
    elsewhere = registration("/kubepods/other/cid-1", hierarchy)
    os.setxattr(directory, MARK_XATTR, encode_mark(elsewhere))
    assert elsewhere not in marks.read_all()
    assert "not believed" in caplog.text


def test_a_mark_whose_init_process_is_gone_is_not_believed(real_cgroup):
    """A registration whose init process exited (another start time on that PID) is stale."""
    marks, hierarchy, path, _directory = real_cgroup
    stale = registration(path, hierarchy, ticks=procfs.read_start_ticks(os.getpid()) + 1)
    assert marks.write(stale) is None
    assert stale not in marks.read_all()


def test_without_cap_sys_admin_a_mark_cannot_be_written(real_cgroup):
    """A container's root has no CAP_SYS_ADMIN: setting the trusted attribute is refused,
    so a tenant cannot forge a registration for its own cgroup."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    _marks, _hierarchy, _path, directory = real_cgroup
    code = f"import os; os.setxattr({directory!r}, {MARK_XATTR!r}, b'forged')"
    done = subprocess.run(
        [
            "setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin",
            sys.executable, "-c", code,
        ],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode != 0 and "Operation not permitted" in done.stderr
    with pytest.raises(OSError, match="No data available"):
        os.getxattr(directory, MARK_XATTR)
