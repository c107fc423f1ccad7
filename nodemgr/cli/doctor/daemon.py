"""Doctor's checks of gpushare-node itself: is it running and ready, and does its ledger open.

The daemon is asked on both sockets: a no-op ``poststop`` on the hook socket proves it
answers, the status document says whether it is healthy and ready, and why not.
"""

from __future__ import annotations

import os

from hooks import protocol
from nodemgr.allocation.audit import audit_ledger, card_capacities
from nodemgr.allocation.ledger import LEDGER_FILE
from nodemgr.cli.doctor.host import Host, SocketProbe, connect_error, stat_socket
from nodemgr.cli.doctor.report import FAIL, PASS, WARN, Result
from nodemgr.config.schema import Settings
from nodemgr.errors import LedgerError
from nodemgr.status.server import query as query_status

# No runtime makes IDs like this (they are 64 hex digits): nothing to unregister.
PROBE_CONTAINER_ID = "gpushare-doctor-probe"


# --- the daemon --------------------------------------------------------------------------


def check_daemon(settings: Settings, host: Host) -> Result:
    hook = probe_hook_socket(settings.hook_socket, host.timeout_seconds)
    status, document = probe_status_socket(settings.status_socket, host.timeout_seconds)
    return daemon_result(settings.hook_socket, hook, settings.status_socket, status, document)


def probe_hook_socket(path: str, timeout: float) -> SocketProbe:
    found = stat_socket(path)
    if found is not None:
        return found
    try:
        answer = protocol.call(
            path, {"stage": protocol.POSTSTOP, "container_id": PROBE_CONTAINER_ID}, timeout
        )
    except protocol.ProtocolError as e:
        return SocketProbe("bad_answer", str(e))
    except OSError as e:
        return connect_error(e)
    if not answer["allowed"]:
        return SocketProbe("bad_answer", answer["message"])
    return SocketProbe("ok")


def probe_status_socket(path: str, timeout: float) -> tuple[SocketProbe, dict | None]:
    found = stat_socket(path)
    if found is not None:
        return found, None
    try:
        return SocketProbe("ok"), query_status(path, timeout)
    except protocol.ProtocolError as e:
        return SocketProbe("bad_answer", str(e)), None
    except OSError as e:
        return connect_error(e), None


def daemon_result(
    hook_path: str,
    hook: SocketProbe,
    status_path: str,
    status: SocketProbe,
    document: dict | None,
) -> Result:
    name = "gpushare-node"
    start = (
        "start it: `systemctl enable --now gpushare-node` (after `nodemgr install`) or "
        "`gpushare-node --config FILE`; if it runs, give doctor the same --config"
    )
    down = "while it is down the hook refuses GPU containers (fail closed)"
    if hook.state == "denied":
        return Result(
            name, WARN, f"{hook_path}: permission denied; not checked", "run `sudo nodemgr doctor`"
        )
    if hook.state in ("missing", "no_dir"):
        return Result(name, FAIL, f"not running: no hook socket at {hook_path}; {down}", start)
    if hook.state == "refused":
        return Result(
            name,
            FAIL,
            f"not running: {hook_path} is a stale socket (nobody listens); {down}",
            start,
        )
    if hook.state == "timeout":
        return Result(
            name,
            FAIL,
            f"{hook_path} does not answer within the timeout: gpushare-node hung?; {down}",
            "look at `journalctl -u gpushare-node` and restart it",
        )
    if hook.state != "ok":
        return Result(
            name,
            FAIL,
            f"{hook_path}: {hook.error or hook.state} (is this gpushare-node's hook socket?)",
            "check enforcement.hook_socket and run_dir match the daemon's config; restart it",
        )
    answering = f"answers on {hook_path}"
    if status.state == "denied":
        return Result(name, PASS, f"{answering}; status socket {status_path} not readable by you")
    if status.state != "ok" or document is None:
        found = "absent" if status.state in ("missing", "no_dir") else status.error or status.state
        return Result(
            name,
            WARN,
            f"{answering}, but its status socket {status_path} is {found}: "
            "`nodemgr status` cannot reach it",
            "give doctor the daemon's --config (status.socket); restart gpushare-node if it "
            "predates the status socket",
        )
    daemon = document.get("daemon") or {}
    who = f"running (pid {daemon.get('pid', '?')}, version {daemon.get('version', '?')})"
    if daemon.get("healthy") is False:
        problems = "; ".join(daemon.get("problems") or ["a background worker is down"])
        return Result(
            name,
            FAIL,
            f"{who} but NOT HEALTHY: {problems}; systemd restarts it once its WatchdogSec "
            f"passes; {answering}",
            "see `nodemgr status` and `journalctl -u gpushare-node`: the line above says why",
        )
    if daemon.get("ready") and daemon.get("registered"):
        return Result(
            name, PASS, f"{who}, ready: registered with kubelet, MPS healthy; {answering}"
        )
    why = []
    if not daemon.get("registered"):
        why.append("not registered with kubelet")
    why += [
        f"GPU{gpu.get('index')}: {gpu.get('problem')}"
        for gpu in document.get("gpus") or []
        if gpu.get("healthy") is False
    ]
    return Result(
        name,
        WARN,
        f"{who} but not ready: {'; '.join(why) or 'MPS not healthy yet'}; {answering}",
        "see `nodemgr status` and `journalctl -u gpushare-node`; fix the kubelet and MPS "
        "lines above",
    )


# --- the ledger --------------------------------------------------------------------------


def check_ledger(settings: Settings) -> Result:
    state_dir = settings.state_dir
    if not os.path.exists(os.path.join(state_dir, LEDGER_FILE)):
        return ledger_result(state_dir, os.path.isdir(state_dir), None, None)
    try:
        cards, _ = card_capacities(settings)  # None without NVML: the gpu check says why
        audit = audit_ledger(state_dir, settings.resources.memory_unit_mib, cards)
    except LedgerError as e:
        return ledger_result(state_dir, True, None, str(e))
    if audit.problems:
        return ledger_result(
            state_dir,
            True,
            None,
            f"the ledger {audit.path} breaks its invariants: {'; '.join(audit.problems[:3])}"
            + (f" (and {len(audit.problems) - 3} more)" if len(audit.problems) > 3 else "")
            + "; to recover, stop gpushare-node, run nodemgr check-ledger for the full list "
            "and restart it: the first reconcile with kubelet's record repairs what kubelet "
            "knows",
        )
    return ledger_result(state_dir, True, (audit.allocations, audit.containers), None)


def ledger_result(
    state_dir: str, dir_exists: bool, counts: tuple[int, int] | None, error: str | None
) -> Result:
    path = os.path.join(state_dir, LEDGER_FILE)
    if error is not None:
        problem, _, recovery = error.partition("; to recover, ")
        return Result(
            "ledger", FAIL, problem, recovery or "see the message; gpushare-node will not start"
        )
    if counts is None:
        where = "" if dir_exists else f" (state_dir {state_dir} does not exist)"
        return Result(
            "ledger",
            WARN,
            f"no ledger yet at {path}{where}: gpushare-node has not run with this state_dir",
            "start gpushare-node; if it already runs, give doctor its --config (state_dir)",
        )
    allocations, containers = counts
    return Result(
        "ledger",
        PASS,
        f"{path} opens read-only: {allocations} allocation(s), {containers} registered "
        "container(s)",
    )
