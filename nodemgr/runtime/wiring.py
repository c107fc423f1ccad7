"""``gpushare-node``: the daemon's entry point and run loop.

``run`` is the whole life of the daemon in one function: serve one device
plugin socket per resource, register each with kubelet, then watch. When
kubelet restarts (it deletes our sockets and recreates kubelet.sock) serve
and register again; every ``reconcile_interval_seconds`` (and right after a
PreStartContainer) compare the ledger with kubelet's PodResources record. On
SIGTERM or SIGINT stop the servers and remove the sockets; on SIGHUP re-read
the config file and apply what can change while running.

Under systemd (``Type=notify``) it says READY=1 once every resource is
registered with kubelet and every shared card's MPS is healthy, keeps
STATUS= to a one-line summary, pings WATCHDOG=1 only from a healthy
iteration of the run loop, and wraps a reload in RELOADING=1 / READY=1.

Exit codes: 0 stopped by signal; 1 cannot start (no GPUs/NVML, ledger); 2 bad
configuration (one line on stderr naming the key).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from mps import MpsLayout
from mps.layout import CONTAINER_PIPE_DIRECTORY
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.config.loading import config_error_line, load_settings
from nodemgr.config.reload import reload_settings
from nodemgr.config.schema import Settings
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.violations import ENV, MEMORY, UNALLOCATED
from nodemgr.enforcement.hookserver import HookServer
from nodemgr.enforcement.procevents import ProcEvents
from nodemgr.enforcement.registry import ContainerRegistry
from nodemgr.enforcement.watchdog import Watchdog
from nodemgr.errors import BindError, ConfigError, GpushareError
from nodemgr.inventory import open_inventory
from nodemgr.kubelet.devicelists import check_device_list_size
from nodemgr.kubelet.podresources import PodResourcesClient
from nodemgr.kubelet.registration import KubeletUnavailable, register
from nodemgr.kubelet.servicer import OPTIONS, PluginServer
from nodemgr.kubernetes.sync import (
    CandidatePods,
    Publisher,
    candidate_filter,
    post_refusal,
    post_violation,
)
from nodemgr.runtime.notify import ServiceNotifier
from nodemgr.status.metrics import Metrics
from nodemgr.status.server import DaemonFacts, LiveStatus, StatusServer
from nodemgr.supervision.supervisor import MpsSupervisor

log = logging.getLogger("gpushare-node")

SOCKET_NAMES = {
    ResourceKind.MEMORY: "gpushare-memory.sock",
    ResourceKind.CORE: "gpushare-core.sock",
    ResourceKind.WHOLE: "gpushare-whole.sock",
}
WATCH_PERIOD_SECONDS = 0.5  # how fast a kubelet restart or a stop request is noticed
REGISTER_RETRY_MAX_SECONDS = 5.0
# The allocation state must be readable this fast for a systemd watchdog ping.
WATCHDOG_LOCK_TIMEOUT_SECONDS = 1.0


def run(
    settings: Settings,
    stop: threading.Event,
    reload_requested: threading.Event | None = None,
    config_path: str | None = None,
    notifier: ServiceNotifier | None = None,
    version: str = "unknown",
) -> None:
    """The daemon's life. ``reload_requested`` (SIGHUP) re-reads ``config_path``."""
    notifier = notifier or ServiceNotifier()
    reload_requested = reload_requested or threading.Event()
    inventory = open_inventory(settings.gpus)
    ledger = supervisor = hook_server = watchdog = status_server = metrics_server = None
    publisher = None
    kube = None  # the Kubernetes adapter, when kubernetes.enabled
    workers_stop = threading.Event()  # the MPS supervisor's and the watchdog's
    podresources = PodResourcesClient(settings.kubelet.pod_resources_socket)
    facts = DaemonFacts(version=version)
    notifier.status("starting: reading GPUs, ledger and MPS")
    try:
        cards = inventory.cards()
        check_device_list_size(cards, settings.resources.memory_unit_mib)
        ledger = Ledger(settings.state_dir)
        layout = MpsLayout(settings.run_dir) if settings.mps.enabled else None
        # Started first: pod identity should be ready when kubelet admits the first pod.
        kube = _start_kubernetes(settings)
        pods = CandidatePods(kube) if kube is not None else None
        allocator = Allocator(settings, cards, ledger, mps_layout=layout, pods=pods)
        if kube is not None:
            allocator.on_refusal = lambda demand, message: post_refusal(kube, demand, message)
        _log_inventory(allocator)
        if layout is not None:
            # Before serving: the first shared container must not wait for MPS.
            supervisor = MpsSupervisor(
                settings.mps, layout, inventory, allocator, settings.resources.memory_unit_mib
            )
            supervisor.prepare()
            supervisor.start(workers_stop)
        else:
            log.warning("mps.enabled is false: shared containers get env quotas only, no MPS")
        # Before serving too: a container admitted now is checked at its creation.
        registry = ContainerRegistry(
            ledger, allocator, CONTAINER_PIPE_DIRECTORY if layout is not None else None
        )
        hook_server = HookServer(registry, settings.hook_socket)
        hook_server.start()
        watchdog = Watchdog(
            settings.enforcement,
            registry,
            allocator,
            inventory,
            ledger,
            supervisor.control_pids if supervisor is not None else set,
        )
        if kube is not None:
            watchdog.on_violation = lambda v, card, action: post_violation(kube, v, card, action)
        watchdog.start(workers_stop, ProcEvents)
        status = LiveStatus(
            settings.node_name,
            facts,
            allocator,
            ledger,
            registry,
            supervisor.views if supervisor is not None else None,
            lambda: watchdog.last_usage,
            lambda: _enforcement_summary(watchdog),
        )
        status.remember_cards()
        status_server = StatusServer(status, settings.status_socket)
        status_server.start()
        metrics = Metrics(status.document)
        if settings.metrics.enabled:
            try:
                metrics_server = metrics.serve(settings.metrics.address)
                facts.metrics_address = _host_port(settings.metrics.address, metrics_server.port)
                log.info("metrics at http://%s/metrics", facts.metrics_address)
            except BindError as e:
                # The device plugin matters more than its metrics: run on, say it loudly.
                log.error("%s; running on without metrics", e)
        observe_allocate = metrics.observe_allocate if settings.metrics.enabled else None
        if kube is not None:
            publisher = Publisher(
                kube,
                allocator,
                status.document,
                settings.resources.memory_unit_mib,
                settings.mps.enabled,
                settings.kubernetes.label_prefix,
            )
            publisher.start(workers_stop)
        kubelet_socket = os.path.join(settings.kubelet.device_plugin_dir, "kubelet.sock")
        next_reconcile = 0.0
        while not stop.is_set():
            # kubelet creates this directory, but we may start first (boot, a new node).
            os.makedirs(settings.kubelet.device_plugin_dir, mode=0o755, exist_ok=True)
            servers = [
                PluginServer(
                    allocator,
                    kind,
                    os.path.join(settings.kubelet.device_plugin_dir, name),
                    observe_allocate=observe_allocate,
                )
                for kind, name in SOCKET_NAMES.items()
                if kind in allocator.resource_names
            ]
            for server in servers:
                server.start()
            facts.registered = False
            kubelet_inode = _register_all(servers, kubelet_socket, stop, notifier, allocator)
            facts.registered = kubelet_inode is not None
            while kubelet_inode is not None and not stop.wait(_loop_period(notifier)):
                if _inode(kubelet_socket) != kubelet_inode or not all(
                    s.socket_present() for s in servers
                ):
                    log.warning(
                        "kubelet restarted or stopped (its socket or ours was removed or "
                        "recreated): serving and registering again"
                    )
                    break
                if reload_requested.is_set():
                    reload_requested.clear()
                    settings = _reload(settings, config_path, notifier, allocator, supervisor,
                                       watchdog)  # fmt: skip
                if time.monotonic() >= next_reconcile or allocator.reconcile_requested.is_set():
                    allocator.reconcile_requested.clear()
                    _reconcile(allocator, podresources, metrics)
                    next_reconcile = time.monotonic() + settings.kubelet.reconcile_interval_seconds
                _tell_systemd(notifier, facts, allocator, len(servers))
            for server in servers:
                server.stop()
        notifier.stopping()
        log.info("stopped; sockets removed")
    finally:
        # MPS control daemons are left running: their clients outlive us.
        workers_stop.set()
        for server in (hook_server, status_server, metrics_server):
            if server is not None:
                server.stop()
        if watchdog is not None:
            watchdog.join(timeout=2)
        if supervisor is not None or publisher is not None:
            allocator.wake_watchers()
        for worker in (supervisor, publisher):
            if worker is not None:
                worker.join(timeout=2)
        if kube is not None:
            kube.stop()
        podresources.close()
        if ledger is not None:
            ledger.close()
        inventory.close()


def _start_kubernetes(settings: Settings):
    """The started Kubernetes adapter, or None with kubernetes.enabled false."""
    if not settings.kubernetes.enabled:
        log.info(
            "kubernetes.enabled is false: a plain device plugin (no pod identity, "
            "annotations, labels or events)"
        )
        return None
    # Imported only when used: the kubernetes client alone is ~20 MiB of memory.
    from nodemgr.kubernetes.adapter import KubeAdapter

    shared_resources = (settings.resources.memory, settings.resources.core)
    kube = KubeAdapter(
        settings.kubernetes,
        settings.node_name,
        candidate_filter=candidate_filter(shared_resources),
    )
    kube.start()
    return kube


def _tell_systemd(
    notifier: ServiceNotifier, facts: DaemonFacts, allocator: Allocator, resources: int
) -> None:
    """One healthy iteration of the run loop: READY once, STATUS when it changed, WATCHDOG."""
    problems = allocator.card_problems()
    summary = (
        f"serving {resources} resources on {len(allocator.cards)} GPUs, "
        f"{len(allocator.allocations())} allocations"
    )
    if problems:
        summary += "; " + "; ".join(
            f"{allocator.card_label(uuid)}: {problem}" for uuid, problem in sorted(problems.items())
        )
    if not facts.ready and not problems:
        facts.ready = True
        notifier.ready(summary)
        log.info("ready: %s", summary)
    elif not facts.ready:
        notifier.status(f"waiting for MPS: {summary}")
    else:
        notifier.status(summary)
    # A deadlocked allocator cannot answer Allocate: then no ping, and systemd restarts us.
    if allocator.responsive(WATCHDOG_LOCK_TIMEOUT_SECONDS):
        notifier.watchdog()


def _reload(
    running: Settings,
    config_path: str | None,
    notifier: ServiceNotifier,
    allocator: Allocator,
    supervisor: MpsSupervisor | None,
    watchdog: Watchdog,
) -> Settings:
    """SIGHUP: apply what can change while running; say what needs a restart."""
    notifier.reloading()
    try:
        loaded = load_settings(config_path)
    except ConfigError as e:
        log.error("reload refused, the running configuration stays: %s", config_error_line(e))
        notifier.ready(f"reload refused: {config_error_line(e)}")
        return running
    settings, applied, restart = reload_settings(running, loaded)
    watchdog.set_settings(settings.enforcement)
    allocator.set_grace_seconds(settings.kubelet.allocation_grace_seconds)
    if supervisor is not None:
        supervisor.set_settings(settings.mps)
    message = f"reloaded {config_path or '(defaults)'}: "
    message += f"applied {', '.join(applied)}" if applied else "nothing to apply"
    if restart:
        message += f"; needs a restart to take effect: {', '.join(restart)}"
    log.log(logging.WARNING if restart else logging.INFO, "%s", message)
    notifier.ready(message)
    return settings


def _enforcement_summary(watchdog: Watchdog) -> dict:
    violations = {kind: watchdog.counts.get(kind, 0) for kind in (MEMORY, ENV, UNALLOCATED)}
    return {"action": watchdog.action, "violations": violations, "kills": watchdog.kills}


def _register_all(
    servers: list[PluginServer],
    kubelet_socket: str,
    stop: threading.Event,
    notifier: ServiceNotifier,
    allocator: Allocator,
):
    """Register every resource once kubelet is there; kubelet.sock's inode, or None if stopped.

    Waiting for kubelet is healthy: systemd's watchdog keeps being pinged meanwhile."""
    delay, waiting_logged, next_try = 0.2, False, 0.0
    while not stop.is_set():
        inode = _inode(kubelet_socket)
        if inode is None:
            if not waiting_logged:
                log.info("waiting for kubelet: %s does not exist yet", kubelet_socket)
                waiting_logged = True
            notifier.status(f"waiting for kubelet: {kubelet_socket} does not exist yet")
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
                notifier.status(f"waiting for kubelet: {e}")
                next_try = time.monotonic() + delay
                delay = min(delay * 2, REGISTER_RETRY_MAX_SECONDS)
        if allocator.responsive(WATCHDOG_LOCK_TIMEOUT_SECONDS):
            notifier.watchdog()
        # Short steps: a new kubelet.sock is seen at once, and watchdog pings stay on time.
        stop.wait(_loop_period(notifier))
    return None


def _reconcile(allocator: Allocator, podresources: PodResourcesClient, metrics: Metrics) -> None:
    try:
        record = podresources.list()
    except KubeletUnavailable as e:
        # Never release anything on a failed read: kubelet may just be restarting.
        log.warning("reconcile skipped: %s", e)
        metrics.count_reconcile("skipped")
        return
    try:
        plan = allocator.reconcile(record)
    except GpushareError as e:
        log.error("reconcile failed: %s", e)
        metrics.count_reconcile("failed")
        return
    metrics.count_reconcile("ok")
    metrics.count_reconcile_plan(plan)


def _loop_period(notifier: ServiceNotifier) -> float:
    """Seconds between run loop iterations: short enough for systemd's watchdog too."""
    interval = notifier.watchdog_interval_seconds
    return WATCH_PERIOD_SECONDS if interval is None else min(WATCH_PERIOD_SECONDS, interval / 4)


def _host_port(address: str, port: int) -> str:
    """The configured address with the port really bound (port 0 picks one)."""
    return f"{address.rpartition(':')[0]}:{port}"


def _log_inventory(allocator: Allocator) -> None:
    for card in allocator.cards:
        log.info(
            "GPU%d %s (%s): %d MiB, %d %s devices",
            card.index,
            card.uuid,
            card.name,
            card.memory_mib,
            len([d for d in allocator.devices(ResourceKind.MEMORY) if d.id.startswith(card.uuid)]),
            allocator.resource_names[ResourceKind.MEMORY],
        )
    log.info("%d allocations loaded from the ledger", len(allocator.allocations()))


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None
