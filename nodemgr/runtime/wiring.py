"""The daemon's wiring: every part built and started in order, each start followed by its stop.

``run`` is the whole life of the daemon, read top to bottom. MPS control daemons are
left running on exit: their clients outlive us.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from functools import partial

from mps import MpsLayout
from mps.layout import CONTAINER_PIPE_DIRECTORY
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.allocation.recovery import recover_registrations
from nodemgr.common.connbudget import ListenerStats
from nodemgr.common.workers import Workers
from nodemgr.config.schema import Settings
from nodemgr.domain.deviceids import ResourceKind, card_of
from nodemgr.domain.speccheck import DaemonPaths
from nodemgr.dra import plugin as dra_plugin
from nodemgr.dra.cdifiles import CdiDirectory
from nodemgr.dra.driver import DraDriver, node_devices
from nodemgr.dra.plugin import DraPlugin
from nodemgr.dra.recovery import recover_claims
from nodemgr.enforcement import hookserver
from nodemgr.enforcement.cgroupmarks import CgroupMarks
from nodemgr.enforcement.hookserver import HookServer
from nodemgr.enforcement.procevents import ProcEvents
from nodemgr.enforcement.registry import ContainerRegistry
from nodemgr.enforcement.watchdog import Watchdog
from nodemgr.errors import BindError
from nodemgr.inventory import Inventory, open_inventory
from nodemgr.inventory.driverversion import read_driver_version
from nodemgr.kubelet import servicer
from nodemgr.kubelet.devicelists import check_device_list_size
from nodemgr.kubelet.podresources import PodResourcesClient
from nodemgr.kubernetes.dra import META_SLICE, ClaimEvents, DraPublisher, remove_slice
from nodemgr.kubernetes.sync import (
    CandidatePods,
    Publisher,
    candidate_filter,
    post_refusal,
    post_violation,
)
from nodemgr.runtime.loop import RunLoop
from nodemgr.runtime.notify import ServiceNotifier
from nodemgr.status import http
from nodemgr.status import server as status_server
from nodemgr.status.http import MetricsServer
from nodemgr.status.metrics import Metrics
from nodemgr.status.nodefacts import dmem_regions
from nodemgr.status.server import DaemonFacts, LiveStatus, StatusServer
from nodemgr.supervision.supervisor import MpsSupervisor

log = logging.getLogger("gpushare-node")

DRA_LISTENERS = ("dra-registration", "dra-service")


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
    facts = DaemonFacts(version=version)
    notifier.status("starting: reading GPUs, ledger and MPS")
    with contextlib.ExitStack() as stack:
        workers = Workers(stack)
        facts.worker_health = workers.health
        inventory = open_inventory(settings.gpus)
        stack.callback(inventory.close)
        cards = inventory.cards()
        check_device_list_size(cards, settings.resources.memory_unit_mib)
        ledger = Ledger(settings.state_dir)
        stack.callback(ledger.close)
        podresources = PodResourcesClient(settings.kubelet.pod_resources_socket)
        stack.callback(podresources.close)
        # Started first: pod identity should be ready when kubelet admits the first pod.
        kube = _kubernetes(settings, workers)
        layout = MpsLayout(settings.run_dir) if settings.mps.enabled else None
        allocator = Allocator(
            settings,
            cards,
            ledger,
            mps_layout=layout,
            pods=CandidatePods(kube) if kube is not None else None,
            on_refusal=partial(post_refusal, kube) if kube is not None else None,
        )
        _log_inventory(allocator)
        # A ledger made at this start while admitted containers still run: take them back
        # (prepared DRA claims first: the registrations name their allocation IDs too).
        if settings.dra.enabled and ledger.created:
            _recover_claims(settings, allocator)
        marks = CgroupMarks.of_this_host()
        recover_registrations(ledger, allocator, marks.read_all, podresources.list)
        # Before serving: the first shared container must not wait for MPS.
        supervisor = _prepared_supervisor(settings, layout, inventory, allocator)
        if supervisor is not None:
            workers.start(supervisor)
        # Before serving too: a container admitted now is checked at its creation.
        pipe_dir = CONTAINER_PIPE_DIRECTORY if layout is not None else None
        # The hook asks kubelet at each GPU container's creation whether its allocation
        # is still held (a freed id is refused at once); 1 s: under the hook's own 2 s.
        hook_kubelet = PodResourcesClient(
            settings.kubelet.pod_resources_socket,
            1.0,
            dra_driver=settings.dra.driver if settings.dra.enabled else None,
        )
        stack.callback(hook_kubelet.close)
        registry = ContainerRegistry(
            ledger,
            allocator,
            pipe_dir,
            kubelet_record=hook_kubelet.list,
            mps_layout=layout,
            marks=marks,
            daemon_paths=DaemonPaths(settings.own_paths(), settings.own_directories()),
        )
        hook_server = workers.start(HookServer(registry, settings.hook_socket))
        watchdog = workers.start(
            Watchdog(
                settings.enforcement,
                registry,
                allocator,
                inventory,
                ledger,
                supervisor.mps_servers if supervisor is not None else frozenset,
                events_source=ProcEvents,
                on_violation=partial(post_violation, kube) if kube is not None else None,
                control_holds=supervisor.control_holds if supervisor is not None else tuple,
            )
        )
        # No GPU container starts while the watchdog cannot judge (it would run unpoliced).
        registry.enforcement_problem = lambda: watchdog.problem
        status = LiveStatus(
            settings.node_name,
            facts,
            allocator,
            ledger,
            registry,
            supervisor.views if supervisor is not None else None,
            lambda: watchdog.last_usage,
            watchdog.summary,
            dmem_regions=dmem_regions(card.uuid for card in cards),
        )
        status.remember_cards()
        status_listener = workers.start(StatusServer(status, settings.status_socket))
        metrics, metrics_server = _metrics(workers, settings, status, facts)
        facts.listener_stats = partial(
            _listener_stats, settings, hook_server, status_listener, metrics_server
        )
        if kube is not None:
            unit_mib, labels = settings.resources.memory_unit_mib, settings.kubernetes.label_prefix
            workers.start(
                Publisher(kube, allocator, status.document, unit_mib, settings.mps.enabled, labels)
            )
        # The DRA front door: after MPS, the hook and the watchdog, as the device plugin.
        facts.dra = _dra(settings, workers, allocator, kube, ledger, status.document, metrics)
        workers.stop_all_first()
        parts = (allocator, supervisor, watchdog, podresources, metrics)
        loop = RunLoop(
            settings,
            config_path,
            notifier,
            facts,
            *parts,
            dead_workers=workers.dead,
            worker_problems=workers.problems,
            check_ledger_file=ledger.check_file,
        )
        loop.run(stop, reload_requested or threading.Event())
        notifier.stopping()
        log.info("stopped; sockets removed")


def _recover_claims(settings: Settings, allocator: Allocator) -> None:
    """nodemgr.dra.recovery"""
    record = PodResourcesClient(
        settings.kubelet.pod_resources_socket, dra_driver=settings.dra.driver
    )
    try:
        recover_claims(
            allocator,
            CdiDirectory(settings.dra.cdi_dir, settings.dra.driver),
            node_devices(allocator.cards),
            settings.node_name,
            settings.resources.memory_unit_mib,
            record.list,
        )
    finally:
        record.close()


def _dra(settings, workers, allocator, kube, ledger, status_document, metrics):
    """The DRA plugin's state when dra.enabled; otherwise None, after queueing the removal
    of a slice this node published."""
    dra = settings.dra
    if not dra.enabled:
        if kube is not None and ledger.get_meta(META_SLICE):
            remove_slice(
                kube, settings.node_name, dra.driver, lambda: ledger.set_meta(META_SLICE, "")
            )
        return None
    driver = DraDriver(
        driver=dra.driver,
        pool=settings.node_name,
        ledger=allocator,
        cards=allocator.cards,
        unit_mib=settings.resources.memory_unit_mib,
        claims=kube,
        cdi_directory=CdiDirectory(dra.cdi_dir, dra.driver),
        reports=ClaimEvents(kube) if kube is not None else None,
        observe_prepare=metrics.observe_prepare if settings.metrics.enabled else None,
    )
    driver.restore()
    if kube is not None:
        workers.start(
            DraPublisher(
                kube,
                allocator,
                status_document,
                driver=dra.driver,
                unit_mib=settings.resources.memory_unit_mib,
                mps_enabled=settings.mps.enabled,
                device_names={card.uuid: name for name, card in driver.devices.items()},
                driver_version=read_driver_version(),
                set_meta=ledger.set_meta,
            )
        )
    plugin = workers.start(DraPlugin(dra, driver))
    return plugin.state


def _kubernetes(settings: Settings, workers: Workers):
    if not settings.kubernetes.enabled:
        log.info(
            "kubernetes.enabled is false: a plain device plugin (no pod identity, "
            "annotations, labels or events)"
        )
        return None
    # Imported only when used: the kubernetes client alone is ~20 MiB of memory.
    from nodemgr.kubernetes.adapter import KubeAdapter

    shared_resources = (settings.resources.memory, settings.resources.core)
    adapter = KubeAdapter(
        settings.kubernetes,
        settings.node_name,
        candidate_filter=candidate_filter(shared_resources),
    )
    return workers.start(adapter)


def _prepared_supervisor(
    settings: Settings, layout: MpsLayout | None, inventory: Inventory, allocator: Allocator
) -> MpsSupervisor | None:
    if layout is None:
        log.warning("mps.enabled is false: shared containers get env quotas only, no MPS")
        return None
    supervisor = MpsSupervisor(
        settings.mps, layout, inventory, allocator, settings.resources.memory_unit_mib
    )
    supervisor.prepare()
    return supervisor


def _metrics(
    workers: Workers, settings: Settings, status: LiveStatus, facts: DaemonFacts
) -> tuple[Metrics, MetricsServer | None]:
    metrics = Metrics(status.document)
    if not settings.metrics.enabled:
        return metrics, None
    address = settings.metrics.address
    try:
        server = workers.start(metrics.bind(address))
    except BindError as e:
        # The device plugin matters more than its metrics: run on, say it loudly.
        log.error("%s; running on without metrics", e)
        return metrics, None
    facts.metrics_address = _host_port(address, server.port)
    log.info("metrics at http://%s/metrics", facts.metrics_address)
    return metrics, server


def listener_caps(settings: Settings) -> dict[str, int]:
    """Each listener's connection cap (what nodemgr.runtime.fdlimit checks)."""
    caps = {"hook": hookserver.MAX_CONNECTIONS, "status": status_server.MAX_CONNECTIONS}
    if settings.metrics.enabled:
        caps["metrics"] = http.MAX_CONNECTIONS
    for name in _plugin_resources(settings):
        caps[f"device-plugin:{name}"] = servicer.MAX_CONNECTIONS
    if settings.dra.enabled:
        for name in DRA_LISTENERS:
            caps[name] = dra_plugin.MAX_CONNECTIONS
    return caps


def _plugin_resources(settings: Settings) -> list[str]:
    resources = settings.resources
    return [name for name in (resources.memory, resources.core, resources.whole) if name]


def _listener_stats(
    settings: Settings,
    hook: HookServer,
    status: StatusServer,
    metrics: MetricsServer | None,
) -> dict[str, ListenerStats]:
    stats = {"hook": hook.stats(), "status": status.stats()}
    if metrics is not None:
        stats["metrics"] = metrics.stats()
    for name in _plugin_resources(settings):
        stats[f"device-plugin:{name}"] = servicer.budget_stats()
    if settings.dra.enabled:
        for name in DRA_LISTENERS:
            stats[name] = dra_plugin.budget_stats()
    return stats


def _host_port(address: str, port: int) -> str:
    return f"{address.rpartition(':')[0]}:{port}"


def _log_inventory(allocator: Allocator) -> None:
    for card in allocator.cards:
        log.info(
            "GPU%d %s (%s): %d MiB, %d %s devices",
            card.index,
            card.uuid,
            card.name,
            card.memory_mib,
            sum(
                card_of(ResourceKind.MEMORY, d.id) == card.uuid
                for d in allocator.devices(ResourceKind.MEMORY)
            ),
            allocator.resource_names[ResourceKind.MEMORY],
        )
    log.info("%d allocations loaded from the ledger", allocator.allocation_count())
