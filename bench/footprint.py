"""What the daemon costs a node: RSS and CPU, idle and while admitting 100 containers/s.

The real gpushare-node on 8 simulated H200 cards with the production defaults
for its periodic work (reconcile every 10 s, MPS control-command check every 30 s
per card, watchdog scan every 1 s at idle), MPS through NVIDIA's real control
binary where this machine has it (scripts/setup-real-parts; it runs without a
GPU), else through the stand-in. The test kubelet admits 384 containers of
2 GiB + 2 %, spread over the cards: 48 per card, MPS's client limit, so a full
node. Then:

- idle, once the fill's after-effects are over (``settle``: the annotation
  writes queued while filling have drained): the daemon's CPU time over a
  window (user + system, from /proc/PID/stat) divided by the window, in % of
  one core, and its RSS. The MPS health checks run the control binary as a
  child process; its CPU is reported on its own (``children``): with the
  stand-in, a Python script, each costs ~100 times NVIDIA's C binary;
- busy: pods of 1 GiB + 1 % admitted (and deleted, oldest first) at 100 per
  second through the test kubelet, rate-limited, on top of the 384; the
  daemon's CPU and RSS over that window, and the rate really reached (the
  test kubelet shares the machine's two cores with the daemon).

Two configurations: the daemon as deployed, with its Kubernetes adapter on
(pods bound to the node in a test API server before kubelet admits them, as
the scheduler does; the adapter watches them and publishes annotations), and
with the adapter off (the device plugin alone), which splits the cost.

The targets (adapter on): RSS at most 80 MiB, idle CPU under 0.5 % of one
core, 100 admissions/s with at most 5 ms of daemon CPU each.

Run: ``.venv/bin/python -m bench.footprint [--idle-seconds 30] [--busy-seconds 10]``
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import psutil

from bench.apiserver_process import ApiServerProcess
from bench.nodes import CARD_COUNT, h200_node, node_name
from bench.report import Figure, table
from nodemgr.domain.deviceids import ResourceKind, card_of
from nodemgr.enforcement.procevents import ProcEvents, ProcEventsUnavailable
from standins import real_parts
from standins.daemon_proc import CORE, MEMORY, MPS_STANDIN, WHOLE, Node
from standins.kubelet_sim import ContainerSpec, TestKubelet

MPS_CLIENTS_PER_CARD = 48
FULL_POD = {MEMORY: 2, CORE: 2}  # 48 per card: 96 GiB of 141 and 96 % of the card
CHURN_POD = {MEMORY: 1, CORE: 1}  # fits in what the full node has left (4 % per card)
CHURN_HELD = 16  # churn pods alive at once: half of the 32 % left on the node
# How long before kubelet's admission the scheduler has bound a pod (the daemon's
# pod watch must have seen it; kubelet itself learns of pods from the API).
API_LEAD_SECONDS = 0.5
MAX_REFUSALS = 20  # while filling the node; more and the section fails
RSS_TARGET_MIB = 80  # idle RSS <= 80 MiB with the adapter on
IDLE_CPU_TARGET_PERCENT = 0.5  # < 0.5 % of a core
CPU_PER_ADMISSION_TARGET_MS = 5.0  # <= 5 ms of daemon CPU per admission
MIB = 1024 * 1024
ADMISSIONS_TARGET_PER_S = 100.0  # admissions/s sustained, adapter on
# The busy phase asks for exactly the target rate, so the rate reached is at most that:
# kept up within 1 % (the last admission's own time) counts as sustained.
ADMISSIONS_MET_PER_S = 99.0
STANDINS_SWITCH_INTERVAL_S = 0.0005  # see busy()


@dataclass
class FullNode:
    node: Node
    kubelet: TestKubelet
    per_card: dict[int, int]  # card index -> allocations
    api: ApiServerProcess | None = None
    # Admissions refused while filling the node (each pod was replaced by another):
    # a full node must take every pod that fits, so any is a finding.
    refusals: list[str] = field(default_factory=list)

    @functools.cached_property
    def node_name(self) -> str:
        return node_name(self.node)  # read once: the config is YAML, slow to parse per pod

    def create_pod(self, namespace: str, name: str, requests: dict[str, int]) -> None:
        """With the API: the scheduler binds the pod before kubelet admits it."""
        if self.api is not None:
            self.api.add_pod(
                namespace,
                name,
                self.node_name,
                containers=[{"name": "main", "requests": {r: str(n) for r, n in requests.items()}}],
            )

    def delete_pod(self, namespace: str, name: str) -> None:
        self.kubelet.remove_pod(namespace, name)
        if self.api is not None:
            self.api.delete_pod(namespace, name)

    def close(self) -> None:
        self.node.cleanup()
        self.kubelet.stop()
        if self.api is not None:
            self.api.stop()


def mps_control_binary() -> tuple[str, str]:
    """(kind, path) of the MPS control binary a node runs: NVIDIA's real one where this
    machine has it (what a GPU node runs; scripts/setup-real-parts installs it), else the
    stand-in, whose every command is a Python start-up."""
    real = real_parts.find()
    if isinstance(real, real_parts.RealParts):
        return "real", real.mps_control
    return "standin", MPS_STANDIN


def full_node(
    allocations: int = CARD_COUNT * MPS_CLIENTS_PER_CARD,
    kubernetes: bool = False,
    control_binary: str = MPS_STANDIN,
) -> FullNode:
    """The daemon with ``allocations`` containers admitted, production intervals.

    ``kubernetes``: a test API server holds the pods (bound to the node before
    admission, as the scheduler does) and the daemon's Kubernetes adapter is on.
    """
    api = None
    if kubernetes:
        api = ApiServerProcess()  # its own process, as on a node (see bench.apiserver_process)
    node = h200_node(
        production_intervals=True,
        resources={"placement": "spread"},
        api=api,
        control_binary=control_binary,
    )
    kubelet = TestKubelet(node.device_plugin_dir, node.pod_resources_socket)
    full = FullNode(node, kubelet, {}, api)
    kubelet.start()
    node.start()
    try:
        for resource in (MEMORY, CORE, WHOLE):
            kubelet.wait_for_resource(resource, timeout=60)
        # The scheduler binds pods before kubelet admits them, and kubelet learns of
        # them from the API too: the daemon's pod watch has them by then.
        for i in range(allocations):
            full.create_pod("full", f"p{i}", FULL_POD)
        if full.api is not None:
            time.sleep(API_LEAD_SECONDS)
        cards = Counter()
        i = 0
        while sum(cards.values()) < allocations:
            pod = f"p{i}"
            if i >= allocations:  # a replacement for a refused pod: bound first, too
                if i >= allocations + MAX_REFUSALS:
                    raise RuntimeError(
                        f"{len(full.refusals)} admissions refused; the first: {full.refusals[0]}"
                    )
                full.create_pod("full", pod, FULL_POD)
                time.sleep(API_LEAD_SECONDS if full.api is not None else 0)
            i += 1
            result = kubelet.admit_pod("full", pod, [ContainerSpec("main", dict(FULL_POD))])
            if not result.ok:
                # As kubelet: the pod fails admission and is deleted; the node goes on.
                full.refusals.append(f"{pod}: {result.error}")
                full.delete_pod("full", pod)
                continue
            memory_ids = result.containers[0].device_ids[MEMORY]
            cards[card_of(ResourceKind.MEMORY, memory_ids[0])] += 1
    except BaseException:
        full.close()
        raise
    index = {uuid: i for i, uuid in enumerate(sorted(cards))}
    full.per_card = {index[uuid]: n for uuid, n in cards.items()}
    return full


@dataclass(frozen=True)
class Usage:
    seconds: float
    cpu_percent: float  # the daemon's own threads, % of one core
    children_cpu_percent: float  # processes it ran and reaped (MPS control commands)
    rss_mib: float  # at the end of the window
    peak_rss_mib: float  # the kernel's high-water mark (VmHWM) since the daemon started


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


class CpuWindow:
    """CPU time of one process (and its reaped children) between start and stop."""

    def __init__(self, pid: int):
        self.pid = pid
        self._process = psutil.Process(pid)
        self._times = self._process.cpu_times()
        self._started = time.monotonic()

    def stop(self) -> Usage:
        times = self._process.cpu_times()
        seconds = time.monotonic() - self._started
        own = (times.user + times.system) - (self._times.user + self._times.system)
        children = (times.children_user + times.children_system) - (
            self._times.children_user + self._times.children_system
        )
        return Usage(
            seconds=seconds,
            cpu_percent=100 * own / seconds,
            children_cpu_percent=100 * children / seconds,
            rss_mib=self._process.memory_info().rss / MIB,
            peak_rss_mib=_peak_rss_mib(self.pid),
        )


class EventCounter:
    """Counts the machine's process events (exec, exit) as the daemon's watchdog sees them.

    The watchdog follows every exec and exit on the machine through the netlink
    process connector, so its idle CPU grows with what else runs there; the
    count says how busy the machine was. None where the connector is missing.
    """

    def __init__(self) -> None:
        self.events = 0
        self.available = False
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._count, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _count(self) -> None:
        # Opened in the thread that reads it, as the daemon's watchdog does.
        try:
            source = ProcEvents()
        except ProcEventsUnavailable:
            self._ready.set()
            return
        self.available = True
        self._ready.set()
        try:
            while not self._stop.is_set():
                news = source.read(0.2)
                self.events += len(news.execs) + len(news.exits)
        finally:
            source.close()

    def stop(self) -> int | None:
        self._stop.set()
        self._thread.join()
        return self.events if self.available else None


# Idle starts once nothing has reached the API server for longer than one reconcile
# period (kubelet.reconcile_interval_seconds, 10 s by default) plus a publish (1 s) and a
# margin. Without the extender's assume times, identical pending pods are told apart by
# a guess that kubelet's PodResources record corrects at the next reconcile; the fill's
# corrections (annotations re-written for the pods whose owner was guessed wrong) come
# up to 10 s after its last admission. They are the admissions' work, not idle.
SETTLE_QUIET_SECONDS = 13.0


def settle(
    full: FullNode, quiet_seconds: float = SETTLE_QUIET_SECONDS, timeout_seconds: float = 90.0
) -> None:
    """Wait until the admissions' after-effects are over: with the adapter on, until the
    API server has had no request for ``quiet_seconds`` (the annotation writes queued
    while filling, and the next reconcile's corrections, have drained), else
    ``quiet_seconds``. Idle starts after that."""
    api = full.api
    if api is None:
        time.sleep(quiet_seconds)
        return
    deadline = time.monotonic() + timeout_seconds
    seen, quiet_since = len(api.requests), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now_seen = len(api.requests)
        if now_seen != seen:
            seen, quiet_since = now_seen, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_seconds:
            return
    raise RuntimeError(f"the API server never went quiet for {quiet_seconds:g} s")


def idle(full: FullNode, seconds: float) -> tuple[Usage, float | None]:
    """The daemon's usage over ``seconds`` of doing nothing, and process events per second."""
    counter = EventCounter()
    window = CpuWindow(full.node.process.pid)
    time.sleep(seconds)
    usage = window.stop()
    events = counter.stop()
    return usage, None if events is None else events / usage.seconds


@dataclass(frozen=True)
class Busy:
    usage: Usage
    admitted: int
    refused: int
    rate_per_second: float  # admissions really made per second


def busy(full: FullNode, seconds: float, rate_per_second: float = ADMISSIONS_TARGET_PER_S) -> Busy:
    """Admit (and delete, oldest first) churn pods at ``rate_per_second`` for ``seconds``."""
    kubelet = full.kubelet
    window = CpuWindow(full.node.process.pid)
    started = time.monotonic()
    held: list[str] = []
    admitted = refused = 0
    # Pods are bound (in the API) this many admissions ahead of kubelet admitting them,
    # by the control plane: a thread of its own, as the scheduler is another process
    # (binding in kubelet's loop would charge the API stand-in's work to each admission).
    lead = max(1, int(API_LEAD_SECONDS * rate_per_second))
    scheduler = Binder(full, lead)
    # The test kubelet, the API server and the scheduler are one Python process here (on a
    # node they are separate processes): a thread waiting for the GIL waits up to the
    # switch interval (5 ms by default) for another to let go, which alone caps kubelet's
    # sequential admissions near 80/s. A short interval stands in for separate processes.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(STANDINS_SWITCH_INTERVAL_S)
    try:
        while time.monotonic() - started < seconds:
            # Rate-limited: admission i starts no earlier than i / rate after the start.
            wait = started + (admitted + refused) / rate_per_second - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            index = admitted + refused
            pod = f"churn{index}"
            scheduler.bind_up_to(index + lead)
            scheduler.wait_bound(index)  # kubelet learns of a pod once it is bound
            result = kubelet.admit_pod("churn", pod, [ContainerSpec("main", dict(CHURN_POD))])
            held.append(pod)
            if result.ok:
                admitted += 1
            else:
                refused += 1
            if len(held) > CHURN_HELD:
                full.delete_pod("churn", held.pop(0))
        elapsed = time.monotonic() - started
        usage = window.stop()
    finally:
        bound = scheduler.stop()
        sys.setswitchinterval(switch_interval)
    for pod in held:
        full.delete_pod("churn", pod)
    for i in range(admitted + refused, bound):  # bound, never admitted
        if full.api is not None:
            full.api.delete_pod("churn", f"churn{i}")
    return Busy(usage, admitted, refused, (admitted + refused) / elapsed)


class Binder:
    """The scheduler's side of the busy phase: binds churn pods (creates them bound to the
    node in the API) in a thread of its own, ahead of kubelet's admissions."""

    def __init__(self, full: FullNode, lead: int):
        self._full = full
        self._cond = threading.Condition()
        self._wanted = lead  # bind pods churn0 .. churn<wanted - 1>
        self._bound = 0
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="binder", daemon=True)
        self._thread.start()

    def bind_up_to(self, count: int) -> None:
        with self._cond:
            self._wanted = max(self._wanted, count)
            self._cond.notify_all()

    def wait_bound(self, index: int, timeout_seconds: float = 30.0) -> None:
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._bound > index or self._error is not None, timeout_seconds
            ):
                raise TimeoutError(f"pod churn{index} was not bound within {timeout_seconds} s")
            if self._error is not None:
                raise RuntimeError(f"binding churn pods failed: {self._error!r}")

    def stop(self) -> int:
        """Stop binding; how many pods were bound (churn0 .. churn<n - 1>)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()
        return self._bound

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._bound < self._wanted)
                if self._stopped:
                    return
                index = self._bound
            try:
                self._full.create_pod("churn", f"churn{index}", CHURN_POD)
            except BaseException as e:  # said to the admitting loop, which fails
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._bound = index + 1
                self._cond.notify_all()


def figures(
    full: FullNode,
    idle_usage: Usage,
    events_per_s: float | None,
    busy_usage: Busy,
    suffix: str = "",
) -> list[Figure]:
    """``suffix`` tells configurations apart: "" for the default one (the targets apply)."""
    peak_mib = max(idle_usage.peak_rss_mib, busy_usage.usage.peak_rss_mib)
    per_card = ", ".join(str(full.per_card[i]) for i in sorted(full.per_card))
    where = " [Kubernetes adapter on]" if full.api is not None else " [adapter off]"
    targeted = suffix == ""

    def target(text: str, met: bool) -> dict:
        return {"target": text, "met": met} if targeted else {}

    return [
        Figure(
            f"footprint_allocations{suffix}",
            sum(full.per_card.values()),
            "allocations held" + where,
            note=f"per card: {per_card}",
        ),
        Figure(
            f"fill_refusals{suffix}",
            len(full.refusals),
            "admissions refused while filling the node" + where,
            target="0",
            met=not full.refusals,
            note=f"first: {full.refusals[0]}" if full.refusals else "",
        ),
        Figure(
            f"idle_rss_mib{suffix}",
            idle_usage.rss_mib,
            "idle RSS (MiB)" + where,
            **target(f"<= {RSS_TARGET_MIB} MiB", idle_usage.rss_mib <= RSS_TARGET_MIB),
        ),
        Figure(
            f"idle_cpu_percent{suffix}",
            idle_usage.cpu_percent,
            f"idle CPU, daemon (% of a core, {idle_usage.seconds:.0f} s)" + where,
            **target(
                f"< {IDLE_CPU_TARGET_PERCENT:g} %", idle_usage.cpu_percent < IDLE_CPU_TARGET_PERCENT
            ),
        ),
        Figure(
            f"idle_proc_events_per_s{suffix}",
            "skipped" if events_per_s is None else events_per_s,
            "idle: process events/s on the machine" + where,
            note="" if events_per_s is not None else "no netlink process connector here",
        ),
        Figure(
            f"idle_children_cpu_percent{suffix}",
            idle_usage.children_cpu_percent,
            "idle CPU, MPS control commands (the binary mps_control_binary names)" + where,
        ),
        Figure(
            f"busy_admissions_per_s{suffix}",
            busy_usage.rate_per_second,
            "busy: admissions per second reached" + where,
            note=f"{busy_usage.refused} refused" if busy_usage.refused else "",
            **target(
                f">= {ADMISSIONS_TARGET_PER_S:g} (asked for {ADMISSIONS_TARGET_PER_S:g}/s; met at "
                f">= {ADMISSIONS_MET_PER_S:g})",
                busy_usage.rate_per_second >= ADMISSIONS_MET_PER_S,
            ),
        ),
        Figure(
            f"busy_cpu_percent{suffix}",
            busy_usage.usage.cpu_percent,
            "busy CPU, daemon (% of a core)" + where,
        ),
        Figure(
            f"busy_cpu_ms_per_admission{suffix}",
            busy_usage.usage.cpu_percent * 10 / busy_usage.rate_per_second,
            "busy: daemon CPU ms per admission" + where,
            **target(
                f"<= {CPU_PER_ADMISSION_TARGET_MS:g}",
                busy_usage.usage.cpu_percent * 10 / busy_usage.rate_per_second
                <= CPU_PER_ADMISSION_TARGET_MS,
            ),
        ),
        Figure(
            f"busy_children_cpu_percent{suffix}",
            busy_usage.usage.children_cpu_percent,
            "busy CPU, MPS control commands (the binary mps_control_binary names)" + where,
        ),
        Figure(f"busy_rss_mib{suffix}", busy_usage.usage.rss_mib, "busy RSS (MiB)" + where),
        Figure(
            f"peak_rss_mib{suffix}",
            max(idle_usage.peak_rss_mib, busy_usage.usage.peak_rss_mib),
            "peak RSS since start (MiB)" + where,
            **target(f"<= {RSS_TARGET_MIB} MiB", peak_mib <= RSS_TARGET_MIB),
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--idle-seconds", type=float, default=30)
    parser.add_argument("--busy-seconds", type=float, default=10)
    parser.add_argument("--kubernetes", action="store_true", help="adapter on, test API server")
    args = parser.parse_args()
    full = full_node(kubernetes=args.kubernetes, control_binary=mps_control_binary()[1])
    try:
        settle(full)
        idle_usage, events_per_s = idle(full, args.idle_seconds)
        busy_usage = busy(full, args.busy_seconds)
    finally:
        full.close()
    print(table(figures(full, idle_usage, events_per_s, busy_usage)))


if __name__ == "__main__":
    main()
