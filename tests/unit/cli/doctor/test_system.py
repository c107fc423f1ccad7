"""Pins doctor's host-system checks: privileges (root with CAP_NET_ADMIN passes, root without
it or a plain user WARN) parsed from /proc/self/status, and the cgroup layout (v2, hybrid and
v1 pass, none FAILs) both as verdicts and read from a fake node tree."""

from __future__ import annotations

import pytest

from nodemgr.cli.doctor import system
from nodemgr.cli.doctor.report import FAIL, PASS, WARN
from tests.unit.cli.doctor.support import fake_node


def test_privileges_need_root_and_cap_net_admin():
    """The effective UID and CapEff are parsed from /proc status; only root with CAP_NET_ADMIN
    passes."""
    euid, caps = system.parse_proc_status("Uid:\t1000\t0\t0\t0\nCapEff:\t0000000000001000\n")
    assert (euid, caps) == (0, 1 << 12)  # the effective UID is the second field
    assert system.privileges_result(0, 1 << 12).status == PASS
    no_cap = system.privileges_result(0, 0)
    assert no_cap.status == WARN and "periodic scan" in no_cap.detail
    user = system.privileges_result(1000, 0)
    assert user.status == WARN and "uid 1000" in user.detail
    assert "sudo nodemgr doctor" in user.fix


def test_privileges_read_from_proc_status(tmp_path):
    """check_privileges reads the fake root's /proc/self/status: a user WARNs, root with all caps
    passes."""
    assert system.check_privileges(fake_node(str(tmp_path), uid=1000)).status == WARN
    assert system.check_privileges(fake_node(str(tmp_path / "r"), uid=0)).status == PASS


def test_cgroup_verdicts():
    """cgroup v2, hybrid and v1 pass; no hierarchy at all FAILs with the mount command as fix."""
    assert system.cgroup_result("v2", []).status == PASS
    hybrid = system.cgroup_result("hybrid", ["memory"])
    assert hybrid.status == PASS and "support v1 and v2" in hybrid.detail
    assert system.cgroup_result("v1", ["memory", "pids"]).status == PASS
    none = system.cgroup_result("none", [])
    assert none.status == FAIL and "mount -t cgroup2" in none.fix


@pytest.mark.parametrize(
    ("layout", "status", "found"),
    [
        ("v2", PASS, "cgroup v2"),
        ("hybrid", PASS, "hybrid"),
        ("v1", PASS, "cgroup v1 (memory, pids hierarchies)"),
        ("none", FAIL, "no cgroup hierarchy"),
    ],
)
def test_cgroup_layout_of_a_fake_root(tmp_path, layout, status, found):
    """check_cgroups tells each layout apart from the files mounted under a fake /sys/fs/cgroup."""
    result = system.check_cgroups(fake_node(str(tmp_path), cgroup=layout))
    assert result.status == status and found in result.detail
