"""Helpers the doctor tests share: a fake node tree, short socket paths, listening sockets."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

from nodemgr.cli.doctor.host import Host

REPO = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
)
SHIPPED_HOOKS_D = os.path.join(REPO, "hooks", "oci-hooks.d")
SHIPPED_CONTAINERD_HOOKS = os.path.join(REPO, "hooks", "containerd", "gpushare-hooks.json")
HOOK_BIN = "/etc/gpushare/gpushare-hook"  # the launcher the shipped hook files name


def short_dir() -> str:
    """A directory for unix sockets: their paths must stay under 108 bytes."""
    return tempfile.mkdtemp(prefix="gsd-", dir="/tmp")


def listening(path: str) -> socket.socket:
    """A unix stream socket bound at ``path`` (its directory created) and listening."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    server.bind(path)
    server.listen(8)
    return server


def write(path: str, text: str, mode: int | None = None) -> str:
    """Write ``text`` to ``path`` (its directory created), optionally chmod it; the path."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    if mode is not None:
        os.chmod(path, mode)
    return path


def fake_node(
    root: str, *, crio_hooks: bool = True, hook_bin: bool = True, cgroup: str = "v2", uid: int = 0
) -> Host:
    """A node tree: /proc/self/status, cgroups, the hook binary and (optionally) CRI-O hooks."""
    cap_eff = "000001ffffffffff" if uid == 0 else "0000000000000000"
    write(f"{root}/proc/self/status", f"Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    with open(f"{root}/proc/self/status", "a") as f:
        f.write(f"CapInh:\t0000000000000000\nCapEff:\t{cap_eff}\n")
    if cgroup == "v2":
        write(f"{root}/sys/fs/cgroup/cgroup.controllers", "cpu memory pids\n")
    elif cgroup == "hybrid":
        write(f"{root}/sys/fs/cgroup/unified/cgroup.controllers", "\n")
        write(f"{root}/sys/fs/cgroup/memory/cgroup.procs", "1\n")
    elif cgroup == "v1":
        write(f"{root}/sys/fs/cgroup/memory/cgroup.procs", "1\n")
        write(f"{root}/sys/fs/cgroup/pids/cgroup.procs", "1\n")
    if hook_bin:
        write(f"{root}{HOOK_BIN}", "#!/bin/sh\nexit 0\n", 0o755)
    if crio_hooks:
        os.makedirs(f"{root}/etc/containers/oci/hooks.d")
        for name in os.listdir(SHIPPED_HOOKS_D):
            shutil.copy(os.path.join(SHIPPED_HOOKS_D, name), f"{root}/etc/containers/oci/hooks.d")
    return Host(root=root, search_path="/nonexistent")
