"""How the daemon's cost scales: 1, 8, 16 cards x 0, 384, 1,000 allocations.

The rule: cost stays flat in allocations and grows at most linearly in
cards. Per card count, the real gpushare-node on that many simulated H200
cards, production intervals, Kubernetes adapter off, placement ``spread``; at
each allocation count: Allocate p99 / floor p99 (the bench makes kubelet's
calls, bench/kubelet_client.py, between calls to a server that does nothing,
as in section 1), then the daemon's idle CPU (% of a core) over a window and
its RSS at the end of it (footprint's CpuWindow).

Pods, the same at every point so that points compare: the fill is memory-only
pods of ONE unit, ``resources.memory_unit_mib`` 136 MiB (1,061 units per
card), pinned from both ends: 1,000 pods fit on one card (at most 144 MiB),
and 16 cards' device list stays under the daemon's 1 MiB limit (at least 135
MiB; simulated cards report no NUMA node). Steady-state pods ask one unit +
1 % (two Allocate calls, pooled as in section 1). A point the daemon refuses
(it exits at start: device list too big) or that does not fit is ``skipped``.

A daemon per point: per card count, one daemon per allocation count, each
filled to it through its own test kubelet, whose PodResources reports the fill
pods (each admission offers the daemon every free ID, ~17,000 on 16 cards, so
filling 16 cards to 1,000 takes about 80 s on 2 cores). The ledger must hold
exactly the point's allocations. Then the idle windows, one daemon after the
other, the others stopped (SIGSTOP: running, their MPS probes start processes
that every daemon's watchdog follows), then the steady-state phases of all
of them interleaved.

Steady state: the bench's own pods are not in PodResources, so the daemon
frees them ``allocation_grace_seconds`` after they were made (60 s in
production): too late for ~100 admissions on a card 94 % full. For the
Allocate phase the daemons are reloaded (SIGHUP) with section 1's intervals
(reconcile 1 s, grace 2 s). Admissions come at ``RATE_PER_S`` in all, in turn
to each daemon (each round of turns in another order), with floor calls
around every one: each point meets the same moments of the machine and the
same floor, so a point's growth over another is that of its Allocate p99
alone. (Measured one point after the other, against a floor of its own, the
p99 ratio of one 8-card point moved between 1.1 and 2.0 from run to run with
nothing changed: the flat rule judged the machine.) Each daemon holds at
most ``WINDOW`` of the bench's pods (each one past that deletes the oldest):
a device is offered again at least 4.5 s after its pod went, after the
daemon freed it, so none the ledger holds is handed out (counted: should be
0).

Figures: per point ``scale_allocate_p99_ratio_c{cards}_a{allocations}``,
``scale_idle_cpu_percent_c.._a..``, ``scale_rss_mib_c.._a..``; two rules, each
the worst of its parts, within ``TOLERANCE`` (25 %, a shared machine's noise):

- ``scale_flat_in_allocations``: per card count, at the most allocations over
  at none: RSS (``scale_rss_growth_c..``), the Allocate p99 ratio
  (``scale_allocate_ratio_growth_c..``) and its p50 ratio
  (``scale_allocate_p50_ratio_growth_c..``). Shown, not judged: the daemon's
  CPU per steady-state admission (``scale_cpu_per_admission_growth_c..``; per
  point ``scale_cpu_ms_per_admission_c.._a..``), which holds the steady
  phase's reconciles, and idle CPU's (``scale_idle_cpu_growth_c..``): a 10 s
  window holds one reconcile, and the machine's other work moves it by more
  than 25 %;
- ``scale_linear_in_cards``: per allocation count, idle CPU at the most cards
  over at the fewest, divided by the card ratio (1: proportional to cards;
  ``scale_idle_cpu_vs_linear_a..``; a window with no CPU tick counts as one).
  RSS has a big fixed part, so its rule is on the RSS a card adds: that of the
  last step (8 to 16 cards) over that of the first (1 to 8; at least
  ``RSS_INCREMENT_FLOOR_MIB`` so that noise on a tiny increment cannot blow it
  up): above 1, each card costs more than the one before
  (``scale_rss_vs_linear_a..``; ``scale_rss_mib_per_card_a..``).
  With two card counts RSS takes the CPU rule.

Run: ``.venv/bin/python -m bench.scale [--cards 1,8,16] [--allocations 0,384,1000]
[--idle-seconds 10] [--admissions 80] [--plot FILE]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field

import grpc

from bench.footprint import CpuWindow, EventCounter
from bench.kubelet_client import DeviceManager, FloorServer
from bench.nodes import H200_MEMORY_MIB, h200_node, plugin_socket
from bench.report import table
from bench.scale_figures import (  # noqa: F401 (re-exported: the bench tests use bench.scale)
    MEMORY_UNIT_MIB,
    RSS_INCREMENT_FLOOR_MIB,
    TOLERANCE,
    Point,
    figures,
    plot,
    title,
)
from nodemgr.config.schema import KubeletSettings
from nodemgr.domain.deviceids import ResourceKind
from standins.daemon_proc import CORE, MEMORY, WHOLE, Node
from standins.kubelet_sim import ContainerSpec, TestKubelet

CARDS = (1, 8, 16)
ALLOCATIONS = (0, 384, 1000)
UNITS_PER_CARD = H200_MEMORY_MIB // MEMORY_UNIT_MIB  # 1061
FILL_POD = {MEMORY: 1}
STEADY_POD = {MEMORY: 1, CORE: 1}
RATE_PER_S = 8.0
WINDOW = 36  # pods held at most: fewer than the 61 units a 1-card, 1,000-pod node has left
FLOOR_CALLS = 2  # before and after each admission
WARMUP_ADMISSIONS = 8  # a new client's first calls (connections): not steady state
STEADY_KUBELET = {"reconcile_interval_seconds": 1, "allocation_grace_seconds": 2}  # section 1's
PRODUCTION_KUBELET = {
    "reconcile_interval_seconds": KubeletSettings.reconcile_interval_seconds,
    "allocation_grace_seconds": KubeletSettings.allocation_grace_seconds,
}
SETTLE_SECONDS = 2.0  # after the reload and the fill, before the idle window
START_TIMEOUT_S = 120.0
PLOT_NAME = "scale_curve.png"
STALE_HOLDER_LOG = "kubelet's record wins"
READY_LOG = "ready: serving"


class Refused(Exception):
    """The daemon would not take the point: why, as it said."""


def measure(
    cards: tuple[int, ...] = CARDS,
    allocations: tuple[int, ...] = ALLOCATIONS,
    idle_seconds: float = 10.0,
    admissions: int = 80,
) -> list[Point]:
    points = []
    for count in cards:
        points += measure_node(count, sorted(allocations), idle_seconds, admissions)
    return points


def measure_node(
    cards: int, levels: list[int], idle_seconds: float, admissions: int
) -> list[Point]:
    """The points of one card count: a daemon per allocation count, each filled to it;
    their idle windows one after the other, the others stopped meanwhile; then their
    steady-state phases interleaved, admission by admission, against one floor."""
    points: dict[int, Point] = {}
    with contextlib.ExitStack() as stack:
        floor_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="gs-floor-"))
        floor = FloorServer(os.path.join(floor_dir, "floor.sock"))
        stack.callback(floor.close)
        rigs: dict[int, Rig] = {}
        for level in levels:
            started = time.monotonic()
            try:
                rigs[level] = stack.enter_context(_filled_rig(cards, level, floor))
            except Refused as e:
                points[level] = Point(cards, level, skipped=str(e))
                continue
            print(f"scale: {cards} card(s), filled to {level} allocations "
                  f"({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip
        for level, rig in rigs.items():
            with _paused([other for other in rigs.values() if other is not rig]):
                points[level] = rig.idle(idle_seconds)
        for rig in rigs.values():
            rig.reload(STEADY_KUBELET)
        try:
            steady([(rig, points[level]) for level, rig in rigs.items()], floor, admissions)
        except Refused as e:  # the phase is shared: no point of this card count has one
            for level in rigs:
                points[level] = Point(cards, level, skipped=str(e))
    for level in rigs:
        point = points[level]
        if point.skipped:
            continue
        print(
            f"scale: {cards} card(s), {level} allocations: Allocate p99 ratio "
            f"{point.ratio:.2f}, idle CPU {point.idle_cpu_percent:.2f} %, RSS "
            f"{point.rss_mib:.1f} MiB",
            flush=True,
        )
    return [points[level] for level in levels]


@contextlib.contextmanager
def _paused(rigs: list[Rig]):
    """The other daemons stopped (SIGSTOP) for one daemon's idle window, then continued.

    Running, their MPS health probes start processes, and every daemon's watchdog
    follows every exec and exit on the machine: a 16-card daemon measured 1.7 to 2.5 %
    idle beside two others, 0.1 to 0.4 % alone."""
    stopped = []
    try:
        for rig in rigs:
            assert rig.node.process is not None
            os.kill(rig.node.process.pid, signal.SIGSTOP)
            stopped.append(rig.node.process.pid)
        yield
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def _filled_rig(cards: int, level: int, floor: FloorServer):
    """A started daemon on ``cards`` cards with its test kubelet, holding ``level``
    allocations; Refused when it will not start or take them."""
    if level > cards * UNITS_PER_CARD:
        raise Refused(
            f"{level} pods of {MEMORY_UNIT_MIB} MiB do not fit on {cards} x "
            f"141 GiB ({cards * UNITS_PER_CARD} units)"
        )
    node = h200_node(
        production_intervals=True,
        resources={"placement": "spread", "memory_unit_mib": MEMORY_UNIT_MIB},
        cards=cards,
    )
    kubelet = TestKubelet(node.device_plugin_dir, node.pod_resources_socket)
    kubelet.start()
    try:
        node.start()
        _wait_ready(node, kubelet)
        rig = Rig(cards, node, kubelet, floor)
        # Filled at the steady phase's intervals, so that the reconciles confirming the fill
        # (every 10 s at production intervals) are over before the idle window.
        rig.reload(STEADY_KUBELET)
        rig.fill(level)
        rig.held = rig.wait_ledger(level)
        time.sleep(SETTLE_SECONDS)
        rig.reload(PRODUCTION_KUBELET)
        yield rig
    finally:
        node.cleanup()
        kubelet.stop()


def _wait_ready(node: Node, kubelet: TestKubelet) -> None:
    """READY (registered, MPS up on every card) and listed; Refused with its words if it exited."""
    assert node.process is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    while READY_LOG not in node.log():
        code = node.process.poll()
        if code is not None:
            said = [line for line in node.log().splitlines() if line.strip()]
            raise Refused(f"the daemon exited ({code}): {said[-1] if said else 'no output'}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"gpushare-node not ready in {START_TIMEOUT_S:g} s:\n{node.log()}")
        time.sleep(0.2)
    for resource in (MEMORY, CORE, WHOLE):
        kubelet.wait_for_resource(resource, timeout=30)


@dataclass
class Rig:
    """One running daemon, its test kubelet, the floor server, and its fill."""

    cards: int
    node: Node
    kubelet: TestKubelet
    floor: FloorServer
    fill_pods: int = 0
    held: int = 0  # allocations in the ledger once filled
    # The memory IDs the fill pods hold: never offered by the bench's own client.
    fill_ids: set[str] = field(default_factory=set)

    def idle(self, idle_seconds: float) -> Point:
        """The idle window at production intervals: the point, without its Allocate phase."""
        time.sleep(SETTLE_SECONDS)
        assert self.node.process is not None
        counter = EventCounter()
        window = CpuWindow(self.node.process.pid)
        time.sleep(idle_seconds)
        usage = window.stop()
        events = counter.stop()
        return Point(
            self.cards,
            self.fill_pods,
            idle_cpu_percent=usage.cpu_percent,
            children_cpu_percent=usage.children_cpu_percent,
            idle_seconds=usage.seconds,
            rss_mib=usage.rss_mib,
            held=self.held,
            events_per_s=None if events is None else events / usage.seconds,
        )

    def fill(self, level: int) -> None:
        """Fill pods through the test kubelet, so that PodResources reports them."""
        while self.fill_pods < level:
            spec = ContainerSpec("main", dict(FILL_POD))
            result = self.kubelet.admit_pod("scale", f"fill{self.fill_pods}", [spec])
            if not result.ok:
                raise Refused(f"fill pod {self.fill_pods + 1} of {level} refused: {result.error}")
            self.fill_ids.update(result.containers[0].device_ids[MEMORY])
            self.fill_pods += 1

    def wait_ledger(self, level: int, timeout: float = 30.0) -> int:
        """Allocations in the ledger, once it holds exactly ``level`` (or the timeout passed)."""
        deadline = time.monotonic() + timeout
        while True:
            held = len(self.node.allocations())
            if held == level or time.monotonic() > deadline:
                return held
            time.sleep(0.5)

    def reload(self, kubelet_settings: dict) -> None:
        """SIGHUP with new kubelet intervals; returns once the daemon says it reloaded."""
        node = self.node
        said = f"reloaded {node.config_path}:"
        before = node.log().count(said)
        node.rewrite_config(lambda config: config["kubelet"].update(kubelet_settings))
        node.signal(signal.SIGHUP)
        node.wait_for(lambda: node.log().count(said) > before, timeout=30, what="the reload")

    def client(self) -> DeviceManager:
        """kubelet's device manager for the bench's own pods: every healthy device but the
        fill's."""
        memory = self.kubelet.devices(MEMORY)
        devices = {
            MEMORY: [d.id for d in memory if d.healthy and d.id not in self.fill_ids],
            CORE: [d.id for d in self.kubelet.devices(CORE) if d.healthy],
        }
        sockets = {
            MEMORY: plugin_socket(self.node, ResourceKind.MEMORY),
            CORE: plugin_socket(self.node, ResourceKind.CORE),
        }
        return DeviceManager(sockets, devices)


def steady(rigs: list[tuple[Rig, Point]], floor: FloorServer, admissions: int) -> None:
    """Admit (and delete) pods at RATE_PER_S in all, in turn on each rig; each point gets
    its rig's Allocate samples and all of the floor's.

    Interleaved, every point meets the same moments of the machine, and one floor
    divides them all: a point's growth over another is their Allocate p99s' alone. One
    point after the other, the p99 ratio of one 8-card point moved from 1.1 to 2.0
    between runs with nothing changed.
    """
    clients = [(rig, point, rig.client()) for rig, point in rigs]
    floor_samples: list[float] = []
    windows: list[CpuWindow] = []
    stale_before = [rig.node.log().count(STALE_HOLDER_LOG) for rig, _, _ in clients]
    try:
        started = time.monotonic()
        turns = (WARMUP_ADMISSIONS + admissions) * len(clients)
        for turn in range(turns):
            if turn == WARMUP_ADMISSIONS * len(clients):
                for _, _, client in clients:
                    client.timings.clear()
                floor_samples.clear()
                windows = [CpuWindow(rig.node.process.pid) for rig, _, _ in clients]
                started = time.monotonic()
            # Rate-limited: steady admission n starts no earlier than n / rate.
            wait = started + (turn - WARMUP_ADMISSIONS * len(clients)) / RATE_PER_S
            if wait - time.monotonic() > 0:
                time.sleep(wait - time.monotonic())
            # Each round of turns in another order: no point always follows the same one.
            round_, place = divmod(turn, len(clients))
            rig, point, client = clients[(place + round_) % len(clients)]
            # Floor calls around each admission, hit by the same noise: twice as many
            # as Allocate calls, so that the floor's p99 is not just its worst call.
            floor_samples += [floor.call() for _ in range(FLOOR_CALLS)]
            try:
                client.admit(f"steady-a{point.allocations}-{round_}", dict(STEADY_POD))
            except grpc.RpcError as e:
                raise Refused(
                    f"steady-state admission {round_} to the daemon holding "
                    f"{point.allocations} allocations refused: {e.details()}"
                ) from e
            floor_samples += [floor.call() for _ in range(FLOOR_CALLS)]
            if client.pods > WINDOW:
                client.remove_oldest()
        seconds = time.monotonic() - started
        cpu = [window.stop() for window in windows]
    finally:
        for _, _, client in clients:
            client.close()
    for (rig, point, client), before, usage in zip(clients, stale_before, cpu, strict=True):
        point.rate_per_s = admissions / seconds
        point.cpu_ms_per_admission = usage.cpu_percent / 100 * usage.seconds * 1000 / admissions
        point.allocate = list(client.timings["Allocate"])
        point.preferred = list(client.timings["GetPreferredAllocation"])
        point.floor = floor_samples
        point.stale_reuses = rig.node.log().count(STALE_HOLDER_LOG) - before


def _counts(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cards", type=_counts, default=CARDS, help="e.g. 1,8,16")
    parser.add_argument("--allocations", type=_counts, default=ALLOCATIONS, help="e.g. 0,384")
    parser.add_argument("--idle-seconds", type=float, default=10)
    parser.add_argument("--admissions", type=int, default=80, help="per point, steady state")
    parser.add_argument("--plot", metavar="FILE", help="write the scale plot (PNG)")
    args = parser.parse_args()
    started = time.monotonic()
    points = measure(args.cards, args.allocations, args.idle_seconds, args.admissions)
    print(table(figures(points)))
    print(f"({time.monotonic() - started:.0f} s)")
    if args.plot and not plot(points, args.plot, title(args.idle_seconds, args.admissions)):
        print("no plot: matplotlib is not installed (bench/run installs it)")


if __name__ == "__main__":
    main()
