"""What the hostile-tenant cases share: the one node they run on (put back to empty before
each case), what they read of the processes, and how an outcome is turned into the text of
a row of docs/attacks.md (what the attacks themselves do is in attacks.py).

The row text is derived from what was observed: the hook's refusal as runc passes it on
(who refused, and its reason with ids and paths replaced by placeholders, so the row is
the same on every run), kills against the deadline the test asserted, counts as counted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

from nodemgr.config.loading import load_settings
from standins import mps_tenant, runc_env
from standins.mps_tenant import MpsNode
from tests.hostile import attacks

# The watchdog's promise with action: kill (docs/configuration.md: "keeps every violation
# under 2 s").
KILL_DEADLINE_SECONDS = 2.0
# Long enough for several watchdog scans (every 0.25 s while GPU processes run).
SCANS_SECONDS = 1.5
QUOTA_GIB = 4  # what each case's pod asks, and its share
SHARE_PERCENT = 30

# --- the node ---------------------------------------------------------------------------


class Site:
    """The node every case runs on: the daemon with NVIDIA's real MPS control binary, the
    test kubelet, runc with the shipped hook."""

    def __init__(self, cluster: MpsNode):
        self.cluster = cluster
        self.grace_mib = load_settings(cluster.node.config_path).enforcement.grace_mib
        self.quota_mib = QUOTA_GIB * 1024

    def reset(self) -> None:
        """No container, no GPU process, no pod, no allocation: as the node started."""
        cluster = self.cluster
        listed = subprocess.run(
            ["runc", "--root", cluster.runtime.state_root, "list", "-q"],
            capture_output=True,
            text=True,
        )
        for container_id in listed.stdout.split():
            cluster.runtime.delete(container_id)
        shutil.rmtree(os.path.join(cluster.runtime.root, "bundles"), ignore_errors=True)
        cluster.set_usage([])
        for namespace, pod, _ in list(cluster.kubelet.allocated()):
            cluster.kubelet.remove_pod(namespace, pod)
        cluster.node.wait_for(
            lambda: not cluster.node.allocations(), 30, "every allocation released"
        )
        assert cluster.node.process.poll() is None, cluster.node.log()

    def admit(
        self, pod: str, memory_gib: int = QUOTA_GIB, core_percent: int = SHARE_PERCENT
    ) -> tuple[dict[str, str], list]:
        return self.cluster.admit(pod, memory_gib=memory_gib, core_percent=core_percent)

    def start(self, name: str, pod: str | None = None, env=None, mounts=(), **options) -> None:
        """A container of ``pod`` (default: its own pod, admitted now) that must start."""
        if env is None:
            env, mounts = self.admit(pod or name)
        done = self.cluster.start_in_pod(name, pod or name, env, mounts, **options)
        assert done.returncode == 0, done.stdout

    def police(self, container: str, *entries: tuple[int, str, int]) -> list:
        """List ``entries`` (PID, card, MiB) of ``container``'s processes as GPU processes
        and wait until a scan judged them (an exec in the container brings it forward).
        From then the watchdog scans every interval_seconds, as it does while any GPU
        process runs (an idle node is scanned every 5 s). Returns the entries."""
        listed = list(entries)
        self.cluster.set_usage(listed)
        self.cluster.runtime.exec(container, "true")
        expected = sum(mib for _, _, mib in listed)
        self.cluster.node.wait_for(
            lambda: (
                sum(a["memory_used_mib"] or 0 for a in self.status()["allocations"]) == expected
            ),
            10,
            f"a scan of {listed}",
        )
        return listed

    def pid_of_a_dead_gpu_process(
        self, container: str, steady: tuple[int, str, int], tries: int = 5
    ) -> subprocess.Popen:
        """A host process (outside every container) with the PID of one of ``container``'s
        GPU processes that the watchdog judged, then saw die (its scans see ``steady`` too)."""
        for _ in range(tries):
            reused = attacks.spawn_at_pid(
                self._dead_gpu_process(container, steady), ["sleep", "1000"]
            )
            if reused is not None:
                return reused
        raise AssertionError(f"other processes took the PIDs first, {tries} times")

    def _dead_gpu_process(self, container: str, steady: tuple[int, str, int]) -> int:
        """The PID of a GPU process of ``container`` that a scan judged, killed and reaped."""
        node = self.cluster.node
        parent = self.sh(container, attacks.REAPED_CHILD)
        [doomed] = node.wait_for(lambda: mps_tenant.children(parent), 5, "a child")
        self.police(container, steady, (doomed, steady[1], 10))
        os.kill(doomed, signal.SIGKILL)
        node.wait_for(lambda: not os.path.exists(f"/proc/{doomed}"), 5, "reaped")
        return doomed

    def sh(self, container: str, script: str) -> int:
        """``script`` started in the container (detached); its PID as the host sees it."""
        return self.cluster.runtime.exec(container, "sh", "-c", script)

    def status(self) -> dict:
        done = self.cluster.node.nodemgr("status", "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def healthy(self) -> bool:
        """The daemon answers its status socket, with every worker (the watchdog) up."""
        daemon = self.status()["daemon"]
        return daemon["healthy"] is True and daemon["workers"]["watchdog"]["up"] is True

    def set_reconcile_interval(self, seconds: float) -> None:
        """kubelet.reconcile_interval_seconds applied by a reload (SIGHUP), as an admin would
        (the reconcile already scheduled still runs at its time)."""
        node = self.cluster.node
        reloads = node.log().count("reloaded ")
        node.rewrite_config(lambda c: c["kubelet"].update(reconcile_interval_seconds=seconds))
        node.signal(signal.SIGHUP)
        node.wait_for(lambda: node.log().count("reloaded ") > reloads, 10, "the reload")

    def confirm(self, pod: str) -> None:
        """kubelet's PreStartContainer for the pod's container: the daemon reconciles at once
        (the allocation is confirmed as the pod's, so it is released as soon as the pod goes)."""
        self.cluster.kubelet.start_container("default", pod, "main")
        self.wait_log(f"belongs to default/{pod}/main")

    def wait_log(self, *fragments: str, timeout: float = 10) -> str:
        node = self.cluster.node
        return node.wait_for(
            lambda: all(f in (log := node.log()) for f in fragments) and log,
            timeout,
            f"{fragments} in the daemon's log",
        )


def wait_gone(pid: int, seconds: float) -> float | None:
    """Seconds until ``pid`` stopped running, or None if it still runs after ``seconds``."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if not runc_env.running(pid):
            return time.monotonic() - start
        time.sleep(0.01)
    return None


def killed_within(pid: int, what: str) -> str:
    """Asserts the watchdog stopped ``pid`` within its deadline; the row's words for it."""
    took = wait_gone(pid, KILL_DEADLINE_SECONDS + 3)
    assert took is not None, f"{what}: process {pid} still runs"
    assert took < KILL_DEADLINE_SECONDS, f"{what}: killed after {took:.2f} s"
    return f"killed within {KILL_DEADLINE_SECONDS:g} s"


def wait_env_or_gone(pid: int, name: str, value: str, timeout: float = 10.0) -> None:
    """Until /proc/PID/environ shows ``name=value`` (a re-exec took place) or the process
    is gone (killed right after it)."""
    deadline = time.monotonic() + timeout
    while runc_env.running(pid) and environ(pid).get(name) != value:
        assert time.monotonic() < deadline, f"process {pid} never showed {name}={value}"
        time.sleep(0.01)


def go(pid: int, timeout: float = 10.0) -> None:
    """Says go to a process waiting with attacks.AWAIT_GO: SIGUSR1, once /proc/PID/status
    shows its shell catches it (sent earlier, SIGUSR1 would kill it)."""
    usr1 = 1 << (signal.SIGUSR1 - 1)
    deadline = time.monotonic() + timeout
    while not int((_status_field(pid, "SigCgt") or ["0"])[0], 16) & usr1:
        assert time.monotonic() < deadline, f"process {pid} never set its trap on SIGUSR1"
        time.sleep(0.01)
    os.kill(pid, signal.SIGUSR1)


def _status_field(pid: int, name: str) -> list[str] | None:
    """The words of a field of /proc/PID/status; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((line.split()[1:] for line in f if line.startswith(f"{name}:")), None)
    except OSError:
        return None


def nspids(pid: int) -> list[int]:
    """The process's PID in each PID namespace it is in, the host's first."""
    words = _status_field(pid, "NSpid")
    assert words is not None, f"process {pid} is gone"
    return [int(p) for p in words]


def start_ticks_and_pid(pid: int) -> tuple[int, int]:
    """Oldest first, as the watchdog orders processes (start time, then PID)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return int(data[data.rfind(b")") + 2 :].split()[19]), pid


def environ(pid: int) -> dict[str, str]:
    """/proc/PID/environ; empty once the process is gone."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().decode(errors="replace").split("\0")
    except OSError:
        return {}
    return dict(e.partition("=")[::2] for e in entries if "=" in e)


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace").rstrip("\0").split("\0")


# --- what a refusal said, for the row ---------------------------------------------------

# runc logs the hook's stderr Go-quoted: ... msg="... stderr: gpushare-hook: <message>\n".
_RUNC_MSG = re.compile(r'msg="((?:[^"\\]|\\.)*)"')
_HOOK_SAID = re.compile(r"stderr: gpushare-hook: (.*?)\n?$", re.S)
_GO_ESCAPE = re.compile(r"\\(.)")
_WHO = re.compile(r"^(?P<daemon>gpushare-node refused )?(?:container \S+(?: \([^)]*\))?: )?")
_DETAIL = re.compile(r"\s*\([^()]*\)")  # innermost first; repeated for nested ones
_CLAUSE = re.compile(r"(?:: |; )")
# What changes from run to run, elided (no <placeholder>: markdown would take it for HTML).
_PLACEHOLDERS = (
    (re.compile(r"ga-[0-9a-f]{6,}"), "ga-…"),
    (re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f-]{27}"), "GPU-…"),
    (re.compile(r"/tmp/gs-[^/\s]+"), "…"),
)


def hook_said(runc_output: str) -> str | None:
    """What gpushare-hook wrote on stderr, as runc passed it on (unquoted)."""
    for quoted in _RUNC_MSG.findall(runc_output):
        text = _GO_ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), quoted)
        said = _HOOK_SAID.search(text)
        if said:
            return said.group(1)
    return None


def _first_clause(reason: str) -> str:
    """The reason up to its first ': ' or '; ', or further while that is one word (such as
    ``NAME='value'``, whose problem follows)."""
    parts = _CLAUSE.split(reason)
    clause = parts[0]
    for part in parts[1:]:
        if " " in clause:
            break
        clause += ": " + part
    return clause


def refusal(done: subprocess.CompletedProcess, name: str) -> str:
    """Who refused ``name`` (the daemon, or the hook on its own) and why: the message's
    first clause without its parenthesised details, ids and paths elided (the
    explanation and the fix that follow are left out). Asserts it was refused."""
    assert done.returncode != 0, f"{name} started: {done.stdout}"
    message = hook_said(done.stdout)
    assert message, f"no refusal from gpushare-hook for {name}: {done.stdout}"
    who = _WHO.match(message)
    reason = message[who.end() :]
    for pattern, placeholder in _PLACEHOLDERS:
        reason = pattern.sub(placeholder, reason)
    while (shorter := _DETAIL.sub("", reason)) != reason:
        reason = shorter
    reason = _first_clause(reason)
    return f"refused by the {'daemon' if who.group('daemon') else 'hook'}: {reason}"


def not_started(cluster: MpsNode, name: str) -> None:
    assert name not in cluster.registered()
    state = cluster.runtime.state(name)
    assert state is None or state["status"] == "stopped", state
