"""The daemon's run loop: serve kubelet, register, watch, reconcile, reload, tell systemd.

When kubelet restarts (it deletes our sockets and recreates kubelet.sock) the device
plugin servers are started and registered again. The ledger is reconciled with
kubelet's record every ``reconcile_interval_seconds`` and on request; SIGHUP reloads.

Under systemd (``Type=notify``): READY=1 once every resource is registered and every
shared card's MPS is healthy; STATUS= a one-line summary; WATCHDOG=1 only from a
healthy iteration (no worker down or with a problem; STATUS= then says why, and
systemd restarts the daemon after WatchdogSec); a reload in RELOADING=1 / READY=1, its
outcome held in STATUS= for ``RELOAD_STATUS_SECONDS`` so ``systemctl status`` after
``systemctl reload`` shows it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nodemgr.allocation.allocator import Allocator
from nodemgr.config.loading import load_settings
from nodemgr.config.reload import reload_settings
from nodemgr.config.schema import PLUGIN_SOCKETS, Settings
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.enforcement.watchdog import Watchdog
from nodemgr.errors import ConfigError, GpushareError
from nodemgr.kubelet.podresources import PodResourcesClient
from nodemgr.kubelet.registration import KubeletUnavailable, register
from nodemgr.kubelet.servicer import OPTIONS, ObserveAllocate, PluginServer
from nodemgr.runtime.notify import ServiceNotifier
from nodemgr.status.metrics import Metrics
from nodemgr.status.server import DaemonFacts
from nodemgr.supervision.supervisor import MpsSupervisor

log = logging.getLogger("gpushare-node")

SOCKET_NAMES = {
    ResourceKind.MEMORY: PLUGIN_SOCKETS["memory"],
    ResourceKind.CORE: PLUGIN_SOCKETS["core"],
    ResourceKind.WHOLE: PLUGIN_SOCKETS["whole"],
}
WATCH_PERIOD_SECONDS = 0.5  # a kubelet restart or a stop request is noticed this fast
REGISTER_RETRY_MAX_SECONDS = 5.0
# The allocation state must be readable this fast for a systemd watchdog ping.
WATCHDOG_LOCK_TIMEOUT_SECONDS = 1.0
RELOAD_STATUS_SECONDS = 60.0


@dataclass
class _HeldStatus:
    text: str
    until: float  # clock time
    summary: str | None = None  # a change of the summary ends the hold


@dataclass
class RunLoop:
    """What the loop drives; ``settings`` changes with each accepted reload."""

    settings: Settings
    config_path: str | None
    notifier: ServiceNotifier
    facts: DaemonFacts
    allocator: Allocator
    supervisor: MpsSupervisor | None
    watchdog: Watchdog
    podresources: PodResourcesClient
    metrics: Metrics
    clock: Callable[[], float] = time.monotonic
    # Workers.dead
    dead_workers: Callable[[], list[str]] = list
    # Workers.problems
    worker_problems: Callable[[], list[str]] = list
    # Ledger.check_file
    check_ledger_file: Callable[[], str | None] = lambda: None
    _held: _HeldStatus | None = field(default=None, init=False, repr=False)
    _told_ready: bool = field(default=False, init=False, repr=False)  # READY=1 sent

    @property
    def observe_allocate(self) -> ObserveAllocate | None:
        enabled = self.settings.metrics.enabled
        return self.metrics.observe_allocate if enabled else None

    def run(self, stop: threading.Event, reload_requested: threading.Event) -> None:
        plugin_dir = self.settings.kubelet.device_plugin_dir
        kubelet_socket = os.path.join(plugin_dir, "kubelet.sock")
        next_reconcile = 0.0
        while not stop.is_set():
            # kubelet creates this directory, but we may start first (boot, a new node).
            os.makedirs(plugin_dir, mode=0o755, exist_ok=True)
            servers = [
                PluginServer(
                    self.allocator,
                    kind,
                    os.path.join(plugin_dir, name),
                    observe_allocate=self.observe_allocate,
                )
                for kind, name in SOCKET_NAMES.items()
                if kind in self.allocator.resource_names
            ]
            for server in servers:
                server.start()
            self.facts.registered = self.facts.ready = False
            kubelet_inode = self._register_all(servers, kubelet_socket, stop)
            self.facts.registered = kubelet_inode is not None
            # READY=1 and the first reconcile as soon as the last resource is registered.
            while kubelet_inode is not None and not stop.is_set():
                if _inode(kubelet_socket) != kubelet_inode or not all(
                    s.socket_present() for s in servers
                ):
                    log.warning(
                        "kubelet restarted or stopped (its socket or ours was removed or "
                        "recreated): serving and registering again"
                    )
                    break
                self._check_ledger_file()
                if reload_requested.is_set():
                    reload_requested.clear()
                    self._reload()
                if (
                    time.monotonic() >= next_reconcile
                    or self.allocator.reconcile_requested.is_set()
                ):
                    self.allocator.reconcile_requested.clear()
                    self._reconcile()
                    interval = self.settings.kubelet.reconcile_interval_seconds
                    next_reconcile = time.monotonic() + interval
                self._tell_systemd(len(servers))
                stop.wait(self._period())
            for server in servers:
                server.stop()

    def _register_all(
        self, servers: list[PluginServer], kubelet_socket: str, stop: threading.Event
    ) -> int | None:
        """kubelet.sock's inode, or None if stopped. Waiting for kubelet is healthy: the
        watchdog is pinged meanwhile."""
        notifier = self.notifier
        delay, waiting_logged, next_try = 0.2, False, 0.0
        waiting: str | None = None  # STATUS= while waiting for kubelet
        while not stop.is_set():
            inode = _inode(kubelet_socket)
            if inode is None:
                if not waiting_logged:
                    log.info("waiting for kubelet: %s does not exist yet", kubelet_socket)
                    waiting_logged = True
                waiting = f"waiting for kubelet: {kubelet_socket} does not exist yet"
            elif time.monotonic() >= next_try:
                try:
                    for server in servers:
                        if not register(
                            kubelet_socket, server.resource_name, server.endpoint, OPTIONS, stop
                        ):
                            return None
                        log.info(
                            "registered %s with kubelet (endpoint %s)",
                            server.resource_name,
                            server.endpoint,
                        )
                    return inode
                except KubeletUnavailable as e:
                    log.warning("%s; retrying in %g s", e, delay)
                    waiting = f"waiting for kubelet: {e}"
                    next_try = time.monotonic() + delay
                    delay = min(delay * 2, REGISTER_RETRY_MAX_SECONDS)
            unhealthy = self._unhealthy()
            if unhealthy:
                notifier.status(_down_status(unhealthy, waiting or "waiting for kubelet"))
            else:
                if waiting is not None:
                    notifier.status(waiting)
                if self.allocator.responsive(WATCHDOG_LOCK_TIMEOUT_SECONDS):
                    notifier.watchdog()
            # Short steps: a new kubelet.sock is seen at once, and watchdog pings stay on time.
            stop.wait(self._period())
        return None

    def _tell_systemd(self, resources: int) -> None:
        allocator, facts, notifier = self.allocator, self.facts, self.notifier
        problems = allocator.card_problems()
        summary = (
            f"serving {_count(resources, 'resource')} on {_count(len(allocator.cards), 'GPU')}, "
            f"{_count(allocator.allocation_count(), 'allocation')}"
        )
        if problems:
            summary += "; " + "; ".join(
                f"{allocator.card_label(uuid)}: {problem}"
                for uuid, problem in sorted(problems.items())
            )
        unhealthy = self._unhealthy()
        if unhealthy:
            # Not healthy: no READY, no WATCHDOG=1; systemd restarts us after WatchdogSec.
            notifier.status(_down_status(unhealthy, summary))
            return
        # facts.ready is what is true now (status, doctor); READY=1 is told systemd once.
        facts.ready = not problems
        if facts.ready and not self._told_ready:
            self._told_ready = True
            notifier.ready(summary)
            log.info("ready: %s", summary)
        elif not self._told_ready:
            notifier.status(f"waiting for MPS: {summary}")
        else:
            notifier.status(self._reload_outcome(summary) or summary)
        # A deadlocked allocator cannot answer Allocate: then no ping, and systemd restarts us.
        if allocator.responsive(WATCHDOG_LOCK_TIMEOUT_SECONDS):
            notifier.watchdog()

    def _check_ledger_file(self) -> None:
        try:
            self.check_ledger_file()  # logs what it found and did
        except Exception:  # the next write checks again; serving goes on
            log.exception("checking the ledger file failed")

    def _unhealthy(self) -> list[str]:
        try:
            dead = self.dead_workers()
            problems = self.worker_problems()
        except Exception:  # cannot tell: not healthy either
            log.exception("cannot tell which workers are running")
            return ["(unknown: the check failed)"]
        return ([f"{', '.join(dead)} not running"] if dead else []) + problems

    def _reload_outcome(self, summary: str) -> str | None:
        held = self._held
        if held is None:
            return None
        if held.summary is None:
            held.summary = summary
        if held.summary == summary and self.clock() < held.until:
            return held.text
        self._held = None
        return None

    def _tell_reloaded(self, message: str) -> None:
        self.notifier.ready(message)
        self._held = _HeldStatus(message, self.clock() + RELOAD_STATUS_SECONDS)

    def _reload(self) -> None:
        self.notifier.reloading()
        try:
            loaded = load_settings(self.config_path)
        except ConfigError as e:
            # "<key>: <problem>" on one line: config_error_line's "gpushare-node: config
            # error: " prefix, made for stderr, would only crowd STATUS= (cut at 200 chars).
            why = " ".join(f"{e.key}: {e.problem}".split())
            log.error("reload refused, the running configuration stays: %s", why)
            self._tell_reloaded(f"reload refused: {why}")
            return
        settings, applied, restart = reload_settings(self.settings, loaded)
        self.watchdog.set_settings(settings.enforcement)
        self.allocator.set_grace_seconds(settings.kubelet.allocation_grace_seconds)
        if self.supervisor is not None:
            self.supervisor.set_settings(settings.mps)
        self.settings = settings
        message = f"reloaded {self.config_path or '(defaults)'}: "
        message += f"applied {', '.join(applied)}" if applied else "nothing to apply"
        if restart:
            message += f"; needs a restart to take effect: {', '.join(restart)}"
        log.log(logging.WARNING if restart else logging.INFO, "%s", message)
        self._tell_reloaded(message)

    def _reconcile(self) -> None:
        try:
            record = self.podresources.list()
        except KubeletUnavailable as e:
            # Never release anything on a failed read: kubelet may just be restarting.
            log.warning("reconcile skipped: %s", e)
            self.metrics.count_reconcile("skipped")
            return
        try:
            plan = self.allocator.reconcile(record)
        except GpushareError as e:
            log.error("reconcile failed: %s", e)
            self.metrics.count_reconcile("failed")
            return
        self.metrics.count_reconcile("ok")
        self.metrics.count_reconcile_plan(plan)

    def _period(self) -> float:
        """Short enough for systemd's watchdog too."""
        interval = self.notifier.watchdog_interval_seconds
        return WATCH_PERIOD_SECONDS if interval is None else min(WATCH_PERIOD_SECONDS, interval / 4)


def _down_status(unhealthy: list[str], summary: str) -> str:
    """Why first: STATUS= may be cut short."""
    return f"NOT HEALTHY: {'; '.join(unhealthy)}; {summary}"


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
