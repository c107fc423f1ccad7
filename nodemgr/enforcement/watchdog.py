"""The run-time watchdog: GPU processes held to their container's quota.

Each scan takes one snapshot (per-process GPU memory from the inventory; cgroup, start
time and quota env from /proc), asks :mod:`nodemgr.domain.violations` what is wrong and
acts (``kill``: SIGKILL, newest first; ``log``: report only). A violation is logged,
counted and added to the ledger's history once per onset. The netlink process connector
brings a scan forward at an exec in a registered container; without it the periodic
scan alone runs.

One hostile process never stops enforcement for the others: each process is read,
judged and acted on on its own (an unreadable one is logged once and judged fail-closed:
no container, no quota env).

A scan that cannot judge (GPU memory unreadable, or /proc or a kill failing for want of
the daemon's own descriptors) judges nobody on half a picture and sets the worker's
``problem``: the daemon is unhealthy (no WATCHDOG=1 to systemd, STATUS=, status and
metrics say why) and the hook refuses new GPU containers, until a scan judges again.

It spares only the MPS servers of verified control daemons, by the exact (PID, start
time) the MPS supervisor names, never by name, ancestry or claim. Processes holding a
card's control daemon (``control_holds``, from the supervisor) are ``mps_control``
violations like any other.

What it must not do: decide what a violation is (violations.py does) or kill
anything but a GPU process it has just seen break a rule.

Longer than 400 lines: the scan, the event loop and the snapshots share one set of caches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from nodemgr.allocation.ledger import Ledger
from nodemgr.common.workers import ThreadWorker
from nodemgr.config.schema import EnforcementSettings
from nodemgr.domain.containercheck import CgroupError, parse_cgroups
from nodemgr.domain.model import Allocation
from nodemgr.domain.statusdoc import UsageView
from nodemgr.domain.violations import (
    KINDS,
    MPS_CONTROL,
    ControlHold,
    GpuProcess,
    HolderProcess,
    RegistrationIndex,
    Violation,
    allocation_used_mib,
    control_hold_violation,
    find_violations,
    index_registrations,
    registration_of,
)
from nodemgr.enforcement import procfs
from nodemgr.enforcement.registry import ContainerRegistry
from nodemgr.errors import GpushareError
from nodemgr.inventory import Card, Inventory

log = logging.getLogger(__name__)

# An exec in a registered container is scanned this soon: the new process
# needs a moment to create its GPU context before NVML lists it.
EXEC_RESCAN_SECONDS = 0.2
# With no GPU process running and process events flowing: a process outside any
# container, or one that gets its GPU context late, is still met within about a second.
IDLE_SCAN_SECONDS = 1.0
# Registrations whose init process is gone without a poststop are dropped this often
# (one /proc read per registered container), and at once when the init's exit is seen.
PRUNE_SECONDS = 10.0
# A container holding a card's MPS control daemon again this soon loses its init process
# too: a loop starting a new silent client after each kill would stall MPS for good.
HOLD_REPEAT_SECONDS = 600.0
# A larger exec batch brings a scan forward instead of a /proc read each: a flood from any
# pod must not keep the watchdog from scanning.
MAX_EXECS_JUDGED = 64


class CannotJudge(Exception):
    """This scan cannot judge the node's GPU processes (the message says why)."""


class ProcessEventBatch(Protocol):
    """What one read of the process events says (nodemgr.enforcement.procevents.Events)."""

    @property
    def execs(self) -> Collection[int]: ...
    @property
    def exits(self) -> Collection[int]: ...
    @property
    def lost(self) -> bool: ...


class ProcessEventSource(Protocol):
    """The process events (nodemgr.enforcement.procevents.ProcEvents)."""

    def read(self, timeout_seconds: float) -> ProcessEventBatch: ...
    def wake(self) -> None: ...
    def close(self) -> None: ...


class PolicedState(Protocol):
    """The Allocator, as the watchdog sees it."""

    @property
    def cards(self) -> Sequence[Card]: ...
    def allocations_by_id(self) -> dict[str, Allocation]: ...

    def whole_cards(self) -> set[str]: ...

    def card_label(self, card_uuid: str) -> str: ...


class Watchdog(ThreadWorker):
    def __init__(
        self,
        settings: EnforcementSettings,
        registry: ContainerRegistry,
        allocator: PolicedState,
        inventory: Inventory,
        ledger: Ledger,
        mps_servers: Callable[[], Collection[tuple[int, int]]] = frozenset,
        clock: Callable[[], float] = time.time,
        events_source: Callable[[], ProcessEventSource] | None = None,
        on_violation: Callable[[Violation, str, str], None] | None = None,
        control_holds: Callable[[], Collection[ControlHold]] = tuple,
    ):
        super().__init__("watchdog")
        self._settings = settings
        self._registry = registry
        self._allocator = allocator
        self._inventory = inventory
        self._ledger = ledger
        self._mps_servers = mps_servers
        self._control_holds = control_holds
        # Container ID -> hold key -> monotonic onset, for HOLD_REPEAT_SECONDS.
        self._holds_of: dict[str, dict[tuple, float]] = {}
        self._clock = clock
        # Read by the status and metrics threads, under _stats_lock.
        self._stats_lock = threading.Lock()
        self._counts: Counter[str] = Counter()  # onsets by kind
        self._kills = 0
        self._unreadable = 0
        self._failed_scans = 0
        # (pid, start ticks) already logged and counted.
        self._unreadable_seen: set[tuple[int, int]] = set()
        # Posts a pod Event per onset.
        self._on_violation = on_violation
        self._events_source = events_source
        self._active: set[tuple] = set()  # violation keys of the last scan
        # (pid, start ticks) -> cgroups. A process cannot leave its container's cgroup, but
        # it can exec itself with another env, so environ is read at every scan.
        self._cache: dict[tuple[int, int], dict[str, str]] = {}
        self._last_usage: UsageView | None = None
        self._events: ProcessEventSource | None = None
        self._policing = True  # GPU processes ran at the last scan (or none was done)
        self._pruned_at = float("-inf")  # monotonic
        self._raw_usage: list = []

    # -- what other threads read: snapshots taken under the lock ----------------

    @property
    def counts(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self._counts)

    @property
    def kills(self) -> int:
        with self._stats_lock:
            return self._kills

    @property
    def last_usage(self) -> UsageView | None:
        """At the last readable scan; None: unknown."""
        with self._stats_lock:
            return self._last_usage

    def summary(self) -> dict:
        """The status document's ``enforcement`` section."""
        with self._stats_lock:
            violations = {kind: self._counts.get(kind, 0) for kind in KINDS}
            return {
                "action": self._settings.action,
                "violations": violations,
                "kills": self._kills,
                "unreadable_processes": self._unreadable,
                "judging": self.problem is None,
                "problem": self.problem,
                "failed_scans": self._failed_scans,
            }

    @property
    def unreadable(self) -> int:
        with self._stats_lock:
            return self._unreadable

    def _set_last_usage(self, usage: UsageView | None) -> None:
        with self._stats_lock:
            self._last_usage = usage

    # -- the loop --------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        events_source = self._events_source
        events: ProcessEventSource | None = None
        if events_source is not None:
            try:
                events = events_source()
            except Exception as e:  # ProcEventsUnavailable, or an unexpected socket failure
                log.warning("%s: the watchdog relies on its periodic scan alone", e)
        self._events = events  # stop() wakes a read blocked on it
        if stop.is_set() and events is not None:
            events.wake()  # stopped while opening: the first read returns at once
        try:
            next_scan = 0.0
            while not stop.is_set():
                wait = max(0.0, next_scan - time.monotonic())
                if events is None:
                    stop.wait(wait)
                else:
                    try:
                        news = events.read(min(wait, IDLE_SCAN_SECONDS))
                    except Exception:  # a netlink failure must not stop enforcement
                        log.exception("process events failed; the periodic scan alone runs")
                        self._events = None
                        events.close()
                        events = None
                        continue
                    if self._news_wants_a_scan(news):
                        next_scan = min(next_scan, time.monotonic() + EXEC_RESCAN_SECONDS)
                if time.monotonic() >= next_scan and not stop.is_set():
                    try:
                        self.scan()
                    except Exception as e:  # a bug: no judgement this time, and said so
                        log.exception("watchdog scan failed; retrying at the next interval")
                        self._cannot_judge(f"the scan failed ({type(e).__name__}: {e})")
                    next_scan = time.monotonic() + self._scan_interval(events is not None)
        finally:
            self._events = None
            if events is not None:
                events.close()

    def _scan_interval(self, events_flow: bool) -> float:
        """``interval_seconds`` while GPU processes run (memory grows without an event) or
        without process events; else IDLE_SCAN_SECONDS."""
        interval = self._settings.interval_seconds
        if self._policing or not events_flow:
            return interval
        return max(interval, IDLE_SCAN_SECONDS)

    def _news_wants_a_scan(self, news: ProcessEventBatch) -> bool:
        """True when an exec (or a loss of events) needs a scan."""
        if news.exits:
            self._forget_exited(news.exits)
        if news.lost:
            return True
        if not news.execs:
            return False
        if len(news.execs) > MAX_EXECS_JUDGED:
            return True  # one scan (bounded by the GPU processes) beats a read each
        index = index_registrations(self._registry.registrations())  # once per batch
        for pid in news.execs:
            try:
                if self._in_registered_container(pid, index):
                    return True
            except Exception:  # one process must not stop enforcement: scan to be safe
                log.exception("process %d: reading its exec failed; scanning", pid)
                return True
        return False

    def _wake(self) -> None:
        events = self._events
        if events is not None:
            events.wake()

    def scan(self) -> list[Violation]:
        if time.monotonic() - self._pruned_at >= PRUNE_SECONDS:
            self._pruned_at = time.monotonic()
            try:
                self._registry.prune()
            except Exception:  # stale registrations are pruned next time; enforcement goes on
                log.exception("pruning the registered containers failed")
        held, starts = self._held_violations()
        violations = list(held)
        try:
            processes: list[GpuProcess] | None = self._gpu_processes()
        except CannotJudge as e:
            self._cannot_judge(str(e))
            processes = None
        if processes is not None:
            violations += self._process_violations(processes)
            starts.update((p.pid, p.start_ticks) for p in processes)
        # Where usage could not be read, the process violations seen before still last.
        kept = set() if processes is not None else {k for k in self._active if k[0] != MPS_CONTROL}
        active = kept | {violation.key for violation in violations}
        unkilled = self._act(violations, starts)
        self._active = active
        if unkilled is not None:
            self._cannot_judge(unkilled)
        elif processes is not None:
            self._judged()
        return violations

    def _act(self, violations: list[Violation], starts: dict[int, int]) -> str | None:
        """Why a kill could not be done for want of the daemon's own resources, or None."""
        unkilled: str | None = None
        for violation in violations:
            # Each on its own: a report that fails spares neither this offender nor the others.
            if violation.key not in self._active:
                try:
                    self._report(violation)
                except Exception:
                    log.exception("reporting a %s violation failed", violation.kind)
            if self._settings.action == "kill":
                try:
                    self._kill(violation, starts)
                except procfs.Exhausted as e:
                    unkilled = unkilled or f"cannot kill ({violation.kind} violation): {e}"
                except Exception:
                    log.exception("acting on a %s violation failed", violation.kind)
        return unkilled

    def _process_violations(self, processes: list[GpuProcess]) -> list[Violation]:
        self._policing = bool(processes)
        if not processes:  # nothing to judge: no walk over every allocation at idle
            self._set_last_usage(self._usage_view(processes))
            return []
        allocations = self._allocator.allocations_by_id()
        violations = find_violations(
            self._registry.registrations(),
            allocations,
            processes,
            {c.uuid for c in self._allocator.cards},
            self._settings.grace_mib,
            self._allocator.whole_cards(),
        )
        self._set_last_usage(self._usage_view(processes))
        return violations

    def _held_violations(self) -> tuple[list[Violation], dict[int, int]]:
        """The supervisor's holds as violations, and their holders' start times (what a kill
        is checked against)."""
        holds = self._control_holds()
        if not holds:
            return [], {}
        registrations = self._registry.registrations()
        index = index_registrations(registrations)
        allocations = self._allocator.allocations_by_id()
        now = time.monotonic()
        recent = {
            container: {k: t for k, t in keys.items() if now - t < HOLD_REPEAT_SECONDS}
            for container, keys in self._holds_of.items()
        }
        self._holds_of = {container: keys for container, keys in recent.items() if keys}
        violations: list[Violation] = []
        starts = {r.init_pid: r.init_start_ticks for r in registrations}
        for hold in holds:
            holders = [h for h in map(self._holder_process, hold.holders) if h is not None]
            if not holders:
                continue  # all gone: the daemon is free again (the next check shows it)
            key = (MPS_CONTROL, hold.card_uuid, hold.connection, hold.peer)
            # Containers whose processes held MPS through another connection lately.
            again = {c for c, keys in self._holds_of.items() if set(keys) - {key}}
            violation = control_hold_violation(hold, holders, index, allocations, again)
            violations.append(violation)
            starts.update((h.pid, h.start_ticks) for h in holders)
            if violation.container_id is not None:
                self._holds_of.setdefault(violation.container_id, {}).setdefault(key, now)
        return violations, starts

    def _holder_process(self, holder: tuple[int, int]) -> HolderProcess | None:
        """None once it is gone (or its PID is another process's)."""
        pid, start_ticks = holder
        try:
            if procfs.read_start_ticks(pid) != start_ticks:
                return None
        except procfs.ProcfsError:
            return None  # no start time, no safe kill: not judged
        cgroups, problem = {}, None
        try:
            text = procfs.read_cgroups_text(pid)
            cgroups = parse_cgroups(text) if text is not None else {}
        except (procfs.ProcfsError, CgroupError) as e:
            problem = str(e)
        return HolderProcess(pid, start_ticks, cgroups, problem, procfs.in_our_mount_ns(pid))

    def _cannot_judge(self, reason: str) -> None:
        """Logged once per reason."""
        problem = f"enforcement cannot judge: {reason}"
        with self._stats_lock:
            self._failed_scans += 1
        self._set_last_usage(None)  # unknown, not zero
        if problem != self.problem:
            log.error(
                "%s; gpushare-node reports itself unhealthy (no watchdog ping to systemd, "
                "nodemgr status, metrics), refuses new GPU containers and tries again at "
                "every scan",
                problem,
            )
        self.problem = problem

    def _judged(self) -> None:
        if self.problem is not None:
            log.warning("enforcement judges the GPU processes again (%s: over)", self.problem)
            self.problem = None

    @property
    def action(self) -> str:
        return self._settings.action

    def set_settings(self, settings: EnforcementSettings) -> None:
        self._settings = settings

    def _usage_view(self, processes: list[GpuProcess]) -> UsageView:
        card_used: Counter[str] = Counter()
        for entry in self._raw_usage:  # every process, our MPS servers included
            card_used[entry.gpu_uuid] += entry.used_mib
        if not processes:
            return UsageView(dict(card_used), {})
        # Exactly the sum the memory check judges (its own cards, live allocations only).
        allocation_used = allocation_used_mib(
            self._registry.registrations(),
            self._allocator.allocations_by_id(),
            processes,
        )
        return UsageView(dict(card_used), allocation_used)

    def _gpu_processes(self) -> list[GpuProcess]:
        try:
            usage = self._inventory.process_usage()
        except Exception as e:  # NVML's own errors, or anything its binding lets through
            why = e if isinstance(e, GpushareError) else f"{type(e).__name__}: {e}"
            raise CannotJudge(f"cannot read per-process GPU memory: {why}") from e
        self._raw_usage = usage
        servers: Collection[tuple[int, int]] | None = None
        processes = []
        for entry in usage:
            try:
                process = self._gpu_process(entry.pid, entry.gpu_uuid, entry.used_mib)
            except procfs.Exhausted as e:  # ours, not the process's: nobody judged on it
                raise CannotJudge(f"cannot read /proc: {e}") from e
            except Exception:  # a bug on one process must not stop the scan of the others
                log.exception("process %d: cannot be judged; skipped in this scan", entry.pid)
                continue
            if process is None:
                continue
            if servers is None:  # not per process: a failure here fails (retries) the scan
                servers = self._mps_servers()
            if (process.pid, process.start_ticks) in servers:
                continue  # an MPS server of a verified control daemon: ours
            processes.append(process)
        live = {(p.pid, p.start_ticks) for p in processes}
        for key in [k for k in self._cache if k not in live]:
            del self._cache[key]
        listed = {entry.pid for entry in usage}
        self._unreadable_seen = {k for k in self._unreadable_seen if k[0] in listed}
        return processes

    def _gpu_process(self, pid: int, card_uuid: str, used_mib: int) -> GpuProcess | None:
        """None when it is gone; an unreadable file fails closed (see the module)."""
        try:
            start_ticks = procfs.read_start_ticks(pid)
        except procfs.ProcfsError as e:
            _ours_to_raise(e)
            # No start time, no safe kill (a reused PID could be hit): it cannot be judged.
            self._unreadable_once(pid, -1, str(e), "not judged (no safe kill without it)")
            return None
        if start_ticks is None:
            return None  # exited (NVML may list a process for a moment after)
        cgroups = self._cache.get((pid, start_ticks))
        cgroup_problem = None
        if cgroups is None:
            try:
                text = procfs.read_cgroups_text(pid)
                if text is None:
                    return None
                cgroups = parse_cgroups(text)
            except (procfs.ProcfsError, CgroupError) as e:
                _ours_to_raise(e)
                cgroups, cgroup_problem = {}, str(e)
                self._unreadable_once(pid, start_ticks, cgroup_problem, "judged as in no container")
            else:
                self._cache[(pid, start_ticks)] = cgroups
        env_problem = None
        try:
            env = procfs.read_gpu_env(pid)
        except procfs.ProcfsError as e:
            _ours_to_raise(e)
            env, env_problem = {}, str(e)
            self._unreadable_once(pid, start_ticks, env_problem, "judged as without quota env")
        if env is None:
            return None
        # An environ read empty as the process exits is not its env: it must still be there.
        if procfs.read_start_ticks(pid) != start_ticks:
            return None
        return GpuProcess(
            pid, card_uuid, used_mib, start_ticks, cgroups, env, cgroup_problem, env_problem
        )

    def _unreadable_once(self, pid: int, start_ticks: int, problem: str, judged: str) -> None:
        key = (pid, start_ticks)
        if key in self._unreadable_seen:
            return
        self._unreadable_seen.add(key)
        with self._stats_lock:
            self._unreadable += 1
        log.warning("process %d: %s; %s", pid, problem, judged)

    def _in_registered_container(self, pid: int, index: RegistrationIndex) -> bool:
        """True when unknowable."""
        if not index:
            return False  # nothing registered: no exec can be one of ours
        try:
            text = procfs.read_cgroups_text(pid)
            if not text:
                return False
            cgroups = parse_cgroups(text)
        except (procfs.ProcfsError, CgroupError):
            return True  # cannot tell: the next scan judges it
        return registration_of(index, cgroups) is not None

    def _forget_exited(self, pids: Collection[int]) -> None:
        exited = set(pids)
        for key in [k for k in self._cache if k[0] in exited]:
            del self._cache[key]
        if any(r.init_pid in exited for r in self._registry.registrations()):
            self._pruned_at = float("-inf")  # the next scan prunes

    def _report(self, violation: Violation) -> None:
        with self._stats_lock:
            self._counts[violation.kind] += 1
        card = self._allocator.card_label(violation.card_uuid)
        log.warning(
            "violation (%s) by %s, container %s, allocation %s on %s: %s; action: %s",
            violation.kind,
            violation.owner or "unknown pod",
            violation.container_id or "none",
            violation.allocation_id or "none",
            card,
            violation.detail,
            self._settings.action,
        )
        try:
            self._ledger.add_violation(violation, self._settings.action, self._clock())
        except GpushareError as e:
            log.error("cannot record the violation in the ledger: %s", e)
        if self._on_violation is not None:
            try:
                self._on_violation(violation, card, self._settings.action)
            except Exception:  # telling the pod must never stop enforcement
                log.exception("reporting the violation failed")

    def _kill(self, violation: Violation, starts: dict[int, int]) -> None:
        for pid in violation.pids:
            if procfs.kill(pid, starts[pid]):
                with self._stats_lock:
                    self._kills += 1
                log.warning(
                    "killed process %d (%s violation on %s; container %s, pod %s)",
                    pid,
                    violation.kind,
                    self._allocator.card_label(violation.card_uuid),
                    violation.container_id or "none",
                    violation.owner or "unknown",
                )


def _ours_to_raise(error: Exception) -> None:
    """Raise ``error`` again when the failure is the daemon's own (no descriptor left): the
    process must not be judged on it."""
    if isinstance(error, procfs.Exhausted):
        raise error
