"""What the hostile tenants do: the scripts their processes run in busybox containers, the
edits a hostile pod spec makes, trickling clients at the hook socket, a PID had again, and
the host cgroup a spec names. Each attack is described where it is defined."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

# --- what the attacks run in their containers (busybox sh: [, printf, mkdir are applets) ----

# Moves itself into a new cgroup named "gs-<0xff>" below its container's (the pids
# hierarchy of cgroup v1, else the v2 one), then sleeps as the process that holds a GPU.
MOVE_TO_0XFF = (
    "for r in /sys/fs/cgroup/pids /sys/fs/cgroup; do [ -e $r/cgroup.procs ] && break; done; "
    "d=$r/$(printf 'gs-\\377'); mkdir $d && echo $$ > $d/cgroup.procs && exec sleep 1000"
)
# What a script waits with until the test says go (SIGUSR1, see tenant.go): the test reads
# what it needs of the process first, however slowly a loaded machine lets it. A timer in
# its place raced the test when `runc exec` took seconds to return.
AWAIT_GO = "trap 'go=1' USR1; while [ -z \"$go\" ]; do sleep 1; done; "
# On go, rewrites the thread percentage in its own environ memory (what the kernel shows as
# /proc/PID/environ) from 99 to 30 through /proc/self/mem, then stays.
REWRITE_ENVIRON_99_TO_30 = AWAIT_GO + (
    "set -- $(sed 's/.*) //' /proc/$$/stat); shift 47; start=$1; "  # field 50: env_start
    "rel=$(tr '\\0' '\\n' < /proc/$$/environ | "
    "awk '/^CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=/{print o+34; exit} {o+=length($0)+1}'); "
    "exec 3<>/proc/$$/mem; printf 30 | dd bs=1 seek=$((start + rel)) conv=notrunc 1>&3 "
    "2>/dev/null; exec 3>&-; sleep 1000 & wait"
)
# On go, re-execs itself (same PID) with ``env`` raised.
REEXEC_RAISED = AWAIT_GO + "exec env {raised} sleep 1000"
# Starts ``n`` processes at once, then waits for them.
FORK_STORM = "i=0; while [ $i -lt {n} ]; do sleep 1000 & i=$((i+1)); done; wait"
# ``n`` processes that exec and exit at once, one after the other; then it execs a sleep
# whose argument carries how many ran, so the test reads the count from its cmdline.
CHURN = "i=0; while [ $i -lt {n} ]; do /bin/true; i=$((i+1)); done; exec sleep $((100000 + i))"
# A child that can be killed and is then reaped at once (its PID free for reuse).
REAPED_CHILD = "sleep 1000 & wait; sleep 1000"


def writable_cgroups(config: dict) -> None:
    """A pod spec mounting the cgroup filesystem read-write (as privileged-ish pods do)."""
    for mount in config["mounts"]:
        if mount["destination"] == "/sys/fs/cgroup":
            mount["options"] = [o for o in mount.get("options", []) if o != "ro"]


def with_capability(name: str):
    def edit(config: dict) -> None:
        for kind in ("bounding", "effective", "permitted"):
            config["process"]["capabilities"][kind].append(name)

    return edit


def with_device(major: int, minor: int):
    """linux.devices makes /dev/nvidia<minor> (char ``major``:``minor``) in the container."""
    node = {"path": f"/dev/nvidia{minor}", "type": "c", "major": major, "minor": minor,
            "fileMode": 0o666, "uid": 0, "gid": 0}  # fmt: skip

    def edit(config: dict) -> None:
        config["linux"].setdefault("devices", []).append(node)

    return edit


def own_card_rule_and_mknod(config: dict) -> None:
    """Device rules allowing only card 0's node (c 195:0), and CAP_MKNOD to make others."""
    config["linux"]["resources"]["devices"] = [
        {"allow": False, "access": "rwm"},
        {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rw"},
    ]
    with_capability("CAP_MKNOD")(config)


def config_swapped_for(size_bytes: int):
    """A first createRuntime hook that replaces config.json, after runc read it, with a
    sparse file of ``size_bytes`` (valid JSON at its start): what gpushare-hook then finds."""
    code = (
        "import json, os, sys; state = json.load(sys.stdin); "
        "path = os.path.join(state['bundle'], 'config.json'); "
        'f = open(path + \'.big\', \'wb\'); f.write(b\'{"process": {"env": []}, "pad": "\'); '
        f"f.truncate({size_bytes}); f.close(); os.replace(path + '.big', path)"
    )

    def edit(config: dict) -> None:
        swap = {"path": sys.executable, "args": ["python3", "-I", "-c", code]}
        config["hooks"]["createRuntime"].insert(0, swap)

    return edit


# --- trickling clients at the hook socket -----------------------------------------------


@dataclass
class Trickle:
    held: int  # connections the daemon kept open past the first ``AT_ONCE_SECONDS``
    closed_at_once: int
    longest_held_seconds: float
    still_open: int  # after ``watch_seconds``


AT_ONCE_SECONDS = 0.5


def trickle(path: str, connections: int, every_seconds: float, watch_seconds: float) -> Trickle:
    """``connections`` clients that each send one byte every ``every_seconds`` and never a
    whole request; when the daemon closed each, watched for ``watch_seconds``."""
    socks = []
    for _ in range(connections):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        socks.append(sock)
    started = time.monotonic()
    closed_at: dict[int, float] = {}
    next_byte = started
    try:
        while len(closed_at) < connections and time.monotonic() - started < watch_seconds:
            now = time.monotonic()
            send = now >= next_byte
            if send:
                next_byte += every_seconds
            for i, sock in enumerate(socks):
                if i not in closed_at and _closed(sock, send):
                    closed_at[i] = time.monotonic() - started
            time.sleep(0.05)
    finally:
        for sock in socks:
            sock.close()
    at_once = [t for t in closed_at.values() if t < AT_ONCE_SECONDS]
    held = [t for t in closed_at.values() if t >= AT_ONCE_SECONDS]
    return Trickle(
        held=len(held) + connections - len(closed_at),
        closed_at_once=len(at_once),
        longest_held_seconds=max(held, default=0.0),
        still_open=connections - len(closed_at),
    )


def _closed(sock: socket.socket, send: bool) -> bool:
    """Whether the daemon closed this connection (an answer, EOF or a reset)."""
    try:
        if send:
            sock.send(b"{")
        sock.recv(4096, socket.MSG_DONTWAIT)  # an answer, or b"" at EOF: closed either way
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


# --- a host cgroup ---------------------------------------------------------------------


class HostCgroupDirs:
    """The directories runc makes for ``path`` in every hierarchy, removed afterwards
    (those that existed before, such as /system.slice itself, are kept)."""

    def __init__(self, path: str):
        self.path = path
        self.hierarchies = [
            os.path.join("/sys/fs/cgroup", h) for h in os.listdir("/sys/fs/cgroup")
        ] + ["/sys/fs/cgroup"]
        self.existed = {d for h in self.hierarchies for d in self._dirs(h) if os.path.isdir(d)}

    def _dirs(self, hierarchy: str) -> list[str]:
        parts = self.path.strip("/").split("/")
        return [hierarchy + "/" + "/".join(parts[:n]) for n in range(len(parts), 0, -1)]

    def remove(self) -> None:
        for hierarchy in self.hierarchies:
            for directory in self._dirs(hierarchy):  # deepest first
                if directory in self.existed:
                    continue
                try:
                    os.rmdir(directory)
                except OSError:
                    pass


def host_cgroup_dirs(path: str) -> HostCgroupDirs:
    return HostCgroupDirs(path)


# --- a PID used again ------------------------------------------------------------------


def spawn_at_pid(pid: int, argv: list[str], tries: int = 20) -> subprocess.Popen | None:
    """A host process with exactly PID ``pid`` (the kernel's next PID set through
    ns_last_pid: root in the host's PID namespace); None if other processes kept taking it."""
    for _ in range(tries):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        child = subprocess.Popen(argv)
        if child.pid == pid:
            return child
        child.kill()
        child.wait()
        if os.path.exists(f"/proc/{pid}"):
            return None  # someone else's now
    return None
