"""``gpushare-node``: the daemon's entry point and run loop.

``run`` is the whole life of the daemon in one function: serve one device
plugin socket per resource, register each with kubelet, then watch. When
kubelet restarts (it deletes our sockets and recreates kubelet.sock) serve
and register again; every ``reconcile_interval_seconds`` (and right after a
PreStartContainer) compare the ledger with kubelet's PodResources record. On
SIGTERM or SIGINT stop the servers and remove the sockets.

Exit codes: 0 stopped by signal; 1 cannot start (no GPUs/NVML, ledger); 2 bad
configuration (one line on stderr naming the key).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

# gRPC's C core logs connection chatter (GOAWAY on every kubelet restart) to
# stderr; it reads this once, when grpc is first imported, so it is set before
# the imports below bring grpc in. The daemon says what matters in its own log.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from mps import MpsLayout
from mps.layout import CONTAINER_PIPE_DIRECTORY
from nodemgr.allocator import Allocator
from nodemgr.config import Settings, config_error_line, load_settings
from nodemgr.containers import ContainerRegistry
from nodemgr.deviceids import ResourceKind, card_device_ids
from nodemgr.errors import ConfigError, GpushareError
from nodemgr.hookserver import HookServer
from nodemgr.inventory import Card, open_inventory
from nodemgr.kubelet import KubeletUnavailable, PodResourcesClient, register
from nodemgr.ledger import Ledger
from nodemgr.mps_supervisor import MpsSupervisor
from nodemgr.plugin import OPTIONS, PluginServer
from nodemgr.procevents import ProcEvents
from nodemgr.watchdog import Watchdog

log = logging.getLogger("gpushare-node")

SOCKET_NAMES = {
    ResourceKind.MEMORY: "gpushare-memory.sock",
    ResourceKind.CORE: "gpushare-core.sock",
    ResourceKind.WHOLE: "gpushare-whole.sock",
}
WATCH_PERIOD_SECONDS = 0.5  # how fast a kubelet restart or a stop request is noticed
REGISTER_RETRY_MAX_SECONDS = 5.0
# kubelet reads ListAndWatch with gRPC's 4 MiB default limit; keep well under it.
MAX_LIST_BYTES = 1024 * 1024


def run(settings: Settings, stop: threading.Event) -> None:
    inventory = open_inventory(settings.gpus)
    ledger = supervisor = hook_server = watchdog = None
    workers_stop = threading.Event()  # the MPS supervisor's and the watchdog's
    podresources = PodResourcesClient(settings.kubelet.pod_resources_socket)
    try:
        cards = inventory.cards()
        check_device_list_size(cards, settings.resources.memory_unit_mib)
        ledger = Ledger(settings.state_dir)
        layout = MpsLayout(settings.run_dir) if settings.mps.enabled else None
        allocator = Allocator(settings, cards, ledger, mps_layout=layout)
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
        watchdog.start(workers_stop, ProcEvents)
        kubelet_socket = os.path.join(settings.kubelet.device_plugin_dir, "kubelet.sock")
        next_reconcile = 0.0
        while not stop.is_set():
            servers = [
                PluginServer(
                    allocator, kind, os.path.join(settings.kubelet.device_plugin_dir, name)
                )
                for kind, name in SOCKET_NAMES.items()
                if kind in allocator.resource_names
            ]
            for server in servers:
                server.start()
            kubelet_inode = _register_all(servers, kubelet_socket, stop)
            while kubelet_inode is not None and not stop.wait(WATCH_PERIOD_SECONDS):
                if _inode(kubelet_socket) != kubelet_inode or not all(
                    s.socket_present() for s in servers
                ):
                    log.warning(
                        "kubelet restarted or stopped (its socket or ours was removed or "
                        "recreated): serving and registering again"
                    )
                    break
                if time.monotonic() >= next_reconcile or allocator.reconcile_requested.is_set():
                    allocator.reconcile_requested.clear()
                    _reconcile(allocator, podresources)
                    next_reconcile = time.monotonic() + settings.kubelet.reconcile_interval_seconds
            for server in servers:
                server.stop()
        log.info("stopped; sockets removed")
    finally:
        # MPS control daemons are left running: their clients outlive us.
        workers_stop.set()
        if hook_server is not None:
            hook_server.stop()
        if watchdog is not None:
            watchdog.join(timeout=2)
        if supervisor is not None:
            allocator.wake_watchers()
            supervisor.join(timeout=2)
        podresources.close()
        if ledger is not None:
            ledger.close()
        inventory.close()


def _register_all(servers: list[PluginServer], kubelet_socket: str, stop: threading.Event):
    """Register every resource once kubelet is there; kubelet.sock's inode, or None if stopped."""
    delay, waiting_logged = 0.2, False
    while not stop.is_set():
        inode = _inode(kubelet_socket)
        if inode is None:
            if not waiting_logged:
                log.info("waiting for kubelet: %s does not exist yet", kubelet_socket)
                waiting_logged = True
        else:
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
                log.warning("%s; retrying", e)
        stop.wait(delay)
        delay = min(delay * 2, REGISTER_RETRY_MAX_SECONDS)
    return None


def _reconcile(allocator: Allocator, podresources: PodResourcesClient) -> None:
    try:
        record = podresources.list()
    except KubeletUnavailable as e:
        # Never release anything on a failed read: kubelet may just be restarting.
        log.warning("reconcile skipped: %s", e)
        return
    try:
        allocator.reconcile(record)
    except GpushareError as e:
        log.error("reconcile failed: %s", e)


def check_device_list_size(cards: tuple[Card, ...] | list[Card], memory_unit_mib: int) -> None:
    """Refuse a memory unit so small that kubelet could not read the device list."""
    devices = sum(card.memory_mib // memory_unit_mib for card in cards)
    approx_bytes = sum(
        (len(card_device_ids(ResourceKind.MEMORY, card.uuid, 1)[0]) + 16)
        * (card.memory_mib // memory_unit_mib)
        for card in cards
    )
    if approx_bytes > MAX_LIST_BYTES:
        raise ConfigError(
            "resources.memory_unit_mib",
            f"{memory_unit_mib} MiB gives {devices} memory devices on this node, about "
            f"{approx_bytes // 1024} KiB per ListAndWatch message; kubelet refuses messages over "
            "4 MiB: use 1024 (GiB units) or more",
        )


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gpushare-node", description="GPU sharing node daemon: kubelet device plugin"
    )
    parser.add_argument(
        "--config", metavar="FILE", help="YAML configuration (default: built-in defaults)"
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(config_error_line(e), file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    log.info("starting on node %s (GPU backend %s)", settings.node_name, settings.gpus.backend)
    try:
        run(settings, stop)
    except ConfigError as e:
        print(config_error_line(e), file=sys.stderr)
        return 2
    except GpushareError as e:
        log.error("cannot run: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
