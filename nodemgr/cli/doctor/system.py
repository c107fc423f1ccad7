"""Doctor's checks of the host system: privileges (root, CAP_NET_ADMIN) and cgroups.

gpushare-node needs root with CAP_NET_ADMIN (NVML compute modes, MPS mounts, netlink
process events); the hook and the watchdog tell containers apart by cgroup.
"""

from __future__ import annotations

import os

from nodemgr.cli.doctor.host import Host
from nodemgr.cli.doctor.report import FAIL, PASS, WARN, Result

CAP_NET_ADMIN = 12  # bit in /proc/PID/status CapEff (linux/capability.h)


# --- privileges --------------------------------------------------------------------------


def check_privileges(host: Host) -> Result:
    try:
        with open(host.path("/proc/self/status"), encoding="utf-8") as f:
            euid, cap_eff = parse_proc_status(f.read())
    except OSError:
        euid, cap_eff = os.geteuid(), None
    return privileges_result(euid, cap_eff)


def parse_proc_status(text: str) -> tuple[int, int | None]:
    euid, cap_eff = -1, None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields = value.split()
        if name == "Uid" and len(fields) >= 2:
            euid = int(fields[1])
        elif name == "CapEff" and fields:
            cap_eff = int(fields[0], 16)
    return euid, cap_eff


def privileges_result(euid: int, cap_eff: int | None) -> Result:
    net_admin = cap_eff is not None and bool(cap_eff >> CAP_NET_ADMIN & 1)
    if euid == 0 and net_admin:
        return Result("privileges", PASS, "root, with CAP_NET_ADMIN (as gpushare-node must run)")
    if euid == 0:
        return Result(
            "privileges",
            WARN,
            "root without CAP_NET_ADMIN: gpushare-node run like this gets no netlink process "
            "events; its watchdog then relies on the periodic scan alone",
            "run gpushare-node with CAP_NET_ADMIN (not in a capability-restricted container)",
        )
    return Result(
        "privileges",
        WARN,
        f"not root (uid {euid}): doctor cannot probe root-only sockets; gpushare-node must run "
        "as root (NVML compute modes, MPS mounts, CAP_NET_ADMIN for netlink process events)",
        "run `sudo nodemgr doctor`; run gpushare-node as root",
    )


# --- cgroups -----------------------------------------------------------------------------


def check_cgroups(host: Host) -> Result:
    base = host.path("/sys/fs/cgroup")
    if os.path.isfile(os.path.join(base, "cgroup.controllers")):
        layout = "v2"
    elif os.path.isfile(os.path.join(base, "unified", "cgroup.controllers")):
        layout = "hybrid"
    else:
        layout = "v1" if _v1_hierarchies(base) else "none"
    return cgroup_result(layout, _v1_hierarchies(base))


def _v1_hierarchies(base: str) -> list[str]:
    # The controllers the watchdog can key a container by (containercheck.container_cgroup).
    return [h for h in ("memory", "pids") if os.path.isfile(os.path.join(base, h, "cgroup.procs"))]


def cgroup_result(layout: str, v1: list[str]) -> Result:
    if layout == "v2":
        return Result("cgroups", PASS, "cgroup v2 (unified) at /sys/fs/cgroup")
    if layout == "hybrid":
        return Result(
            "cgroups",
            PASS,
            "hybrid: v1 controllers and v2 at /sys/fs/cgroup/unified; containers are keyed by "
            f"their unified cgroup, else their v1 {' or '.join(v1) or 'memory'} cgroup "
            "(the hook and watchdog support v1 and v2)",
        )
    if layout == "v1":
        return Result(
            "cgroups",
            PASS,
            f"cgroup v1 ({', '.join(v1)} hierarchies); the hook and watchdog support v1 and v2",
        )
    return Result(
        "cgroups",
        FAIL,
        "no cgroup hierarchy mounted at /sys/fs/cgroup: the hook cannot tell one container's "
        "processes from another's and refuses GPU containers",
        "mount cgroup v2: `mount -t cgroup2 none /sys/fs/cgroup` (systemd does it at boot)",
    )
