"""Allocate latency over the real unix-socket gRPC path, next to a floor.

The real gpushare-node on 8 simulated H200 cards; the test kubelet registers
its resources. The bench then admits containers of 2 GiB + 1 % the way
kubelet does (bench/kubelet_client.py): per resource GetPreferredAllocation,
then Allocate, over the plugin's unix socket; every call is timed on its own.
Interleaved with them, in the same run and the same client, it calls a
trivial unary RPC on a server that does nothing (bench/floor_server.py, its
own process, the daemon's gRPC settings): the floor, i.e. what any gRPC call
over a unix socket from Python costs on this machine at this moment. It also
calls the daemon's own GetDevicePluginOptions, which splits the gap into
"the daemon's process is busier" and "Allocate does work"; and it times the
work Allocate cannot skip, one fsync'd ledger commit, alone in this process.

Reported: p50/p99 of Allocate (memory and share calls pooled), of the floor,
and their ratios; the target: Allocate p50 and p99 within 2x the floor's.

Steady state: at most ``window`` pods are held; each admission past that
deletes the oldest pod, as a node that keeps admitting. The test kubelet does
not report the bench's pods in PodResources, so the daemon releases each
allocation ``allocation_grace_seconds`` (1 s) after it was made (reconcile every
0.5 s): the window keeps a pod's devices out of reuse longer than that, so
kubelet never hands out a device the ledger still holds (their count is
reported; it should be 0).

Run: ``.venv/bin/python -m bench.allocate_latency [--admissions 2000] [--plot FILE]``
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

from bench.kubelet_client import DeviceManager, FloorServer, plugin_stub, timed
from bench.nodes import h200_node, plugin_socket
from bench.report import Figure, table
from bench.stats import Summary
from nodemgr.allocation.ledger import Ledger
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import Allocation
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2 as dp
from standins.daemon_proc import CORE, MEMORY
from standins.kubelet_sim import TestKubelet

RATIO_TARGET = 2.0  # Allocate p50 and p99 within 2x the floor's
POD = {MEMORY: 2, CORE: 1}  # 2 GiB and 1 % of one card: memory fills a card first (70 < 100)
WARMUP_ADMISSIONS = 50  # connections, caches and the first ledger pages: not steady state
# The daemon's log line when kubelet hands out a device the ledger still holds.
STALE_HOLDER_LOG = "kubelet's record wins"


@dataclass
class Samples:
    """Seconds of each call, by what was called."""

    allocate: list[float]
    preferred: list[float]
    floor: list[float]
    daemon_options: list[float]
    ledger_commit: list[float]
    admissions: int
    stale_reuses: int


def ledger_commits(state_dir: str, count: int) -> list[float]:
    """Seconds of each ledger commit of one new allocation, in this process.

    Allocate's own floor: the fsync'd SQLite transaction it must finish before
    answering, with no gRPC around it, on the filesystem the daemon's ledger uses.
    """
    ledger = Ledger(state_dir)
    seconds = []
    try:
        for i in range(count):
            allocation = Allocation(
                id=f"ga-bench{i:08d}",
                devices={ResourceKind.MEMORY: (f"GPU-bench-_-{i}",)},
                memory_mib=1024,
                created_at=time.time(),
            )
            started = time.perf_counter()
            ledger.commit(put=[allocation])
            seconds.append(time.perf_counter() - started)
    finally:
        ledger.close()
    return seconds


def measure(admissions: int, window: int = 400) -> Samples:
    # The Kubernetes adapter is off (bench/nodes.py): with it, the daemon names the pod
    # being admitted from the API and kubelet's PodResources record, which the bench's
    # own client bypasses; bench/footprint.py admits through the test kubelet with it on.
    # Released within 1.5 s of being made (grace 1 s, reconcile every 0.5 s): the window of
    # held pods must outlast that at the rate Allocate now runs (~100 admissions/s: 4 s).
    node = h200_node(kubelet={"reconcile_interval_seconds": 0.5, "allocation_grace_seconds": 1})
    kubelet = TestKubelet(node.device_plugin_dir, node.pod_resources_socket)
    kubelet.start()
    node.start()
    floor = client = options_channel = None
    try:
        devices = {r: kubelet.wait_for_resource(r, timeout=30) for r in (MEMORY, CORE)}
        floor = FloorServer(os.path.join(node.root, "floor.sock"))
        client = DeviceManager(
            {
                MEMORY: plugin_socket(node, ResourceKind.MEMORY),
                CORE: plugin_socket(node, ResourceKind.CORE),
            },
            {r: [d.id for d in listed if d.healthy] for r, listed in devices.items()},
        )
        options_channel, options = plugin_stub(plugin_socket(node, ResourceKind.MEMORY))
        floor_s: list[float] = []
        daemon_options_s: list[float] = []
        for i in range(WARMUP_ADMISSIONS + admissions):
            if i == WARMUP_ADMISSIONS:
                client.timings.clear()
                floor_s.clear()
                daemon_options_s.clear()
            # Two floor calls per admission, one before each Allocate's turn: as many
            # floor samples as Allocate samples, hit by the same noise.
            floor_s.append(floor.call())
            client.admit(f"p{i}", dict(POD))
            floor_s.append(floor.call())
            daemon_options_s.append(timed(options.GetDevicePluginOptions, dp.Empty())[1])
            if client.pods > window:
                client.remove_oldest()
        commits = ledger_commits(os.path.join(node.root, "ledger-floor"), min(admissions, 1000))
        return Samples(
            allocate=list(client.timings["Allocate"]),
            preferred=list(client.timings["GetPreferredAllocation"]),
            floor=floor_s,
            daemon_options=daemon_options_s,
            ledger_commit=commits,
            admissions=admissions,
            stale_reuses=node.log().count(STALE_HOLDER_LOG),
        )
    finally:
        if options_channel is not None:
            options_channel.close()
        for closable in (client, floor):
            if closable is not None:
                closable.close()
        node.cleanup()
        kubelet.stop()


def figures(samples: Samples) -> list[Figure]:
    us = 1e6
    allocate = Summary.of([s * us for s in samples.allocate])
    floor = Summary.of([s * us for s in samples.floor])
    options = Summary.of([s * us for s in samples.daemon_options])
    preferred = Summary.of([s * us for s in samples.preferred])
    commit = Summary.of([s * us for s in samples.ledger_commit])
    ratio = allocate.p99 / floor.p99
    return [
        Figure("allocate_samples", allocate.n, "Allocate calls timed (memory + share)"),
        Figure("allocate_p50_us", allocate.p50, "Allocate p50 (us)"),
        Figure("allocate_p99_us", allocate.p99, "Allocate p99 (us)"),
        Figure("floor_p50_us", floor.p50, "floor p50: trivial unary gRPC (us)"),
        Figure("floor_p99_us", floor.p99, "floor p99 (us)"),
        Figure(
            "allocate_p99_ratio",
            ratio,
            "Allocate p99 / floor p99",
            target=f"<= {RATIO_TARGET:g}",
            met=ratio <= RATIO_TARGET,
        ),
        Figure(
            "allocate_p50_ratio",
            allocate.p50 / floor.p50,
            "Allocate p50 / floor p50",
            target=f"<= {RATIO_TARGET:g}",
            met=allocate.p50 / floor.p50 <= RATIO_TARGET,
        ),
        Figure("daemon_options_p99_us", options.p99, "daemon GetDevicePluginOptions p99 (us)"),
        Figure("preferred_p99_us", preferred.p99, "GetPreferredAllocation p99 (us)"),
        Figure("ledger_commit_p50_us", commit.p50, "ledger commit alone, p50 (us, no gRPC)"),
        Figure("ledger_commit_p99_us", commit.p99, "ledger commit alone, p99 (us)"),
        Figure(
            "allocate_stale_reuses",
            samples.stale_reuses,
            "devices reused while the ledger held them",
        ),
    ]


def plot(samples: Samples, path: str, title: str) -> None:
    """Histogram and CDF of Allocate, the daemon's trivial call and the floor (log x)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a node or in CI
    import matplotlib.pyplot as plt
    import numpy as np

    series = [
        ("Allocate (memory + share)", samples.allocate, "tab:red"),
        ("daemon GetDevicePluginOptions", samples.daemon_options, "tab:blue"),
        ("floor: trivial server", samples.floor, "tab:gray"),
    ]
    us_all = [s * 1e6 for _, values, _ in series for s in values]
    bins = np.logspace(np.log10(min(us_all) * 0.9), np.log10(max(us_all) * 1.1), 80)
    fig, (hist, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, values, color in series:
        us = np.sort(np.array(values) * 1e6)
        summary = Summary.of(list(us))
        text = f"{label}: p50 {summary.p50:.0f} us, p99 {summary.p99:.0f} us (n={summary.n})"
        hist.hist(us, bins=bins, histtype="step", color=color, linewidth=1.5, label=text)
        cdf.plot(us, np.arange(1, len(us) + 1) / len(us), color=color, label=label)
        for p, style in ((summary.p50, ":"), (summary.p99, "--")):
            hist.axvline(p, color=color, linestyle=style, linewidth=1)
    floor_p99 = Summary.of([s * 1e6 for s in samples.floor]).p99
    cdf.axvline(RATIO_TARGET * floor_p99, color="black", linestyle="--", linewidth=1)
    cdf.text(RATIO_TARGET * floor_p99, 0.05, f" target: {RATIO_TARGET:g} x floor p99", fontsize=8)
    cdf.axhline(0.99, color="black", linestyle=":", linewidth=0.8)
    for ax in (hist, cdf):
        ax.set_xscale("log")
        ax.set_xlabel("latency seen by the caller (us, log scale)")
        ax.grid(True, which="both", alpha=0.3)
    hist.set_ylabel("calls")
    hist.set_title("distribution (dotted: p50, dashed: p99)", fontsize=10)
    hist.legend(fontsize=7, loc="upper right")
    cdf.set_ylabel("fraction of calls")
    cdf.set_title("cumulative (dotted: 0.99)", fontsize=10)
    cdf.legend(fontsize=8, loc="center right")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--admissions", type=int, default=2000)
    parser.add_argument("--window", type=int, default=400, help="pods held at most")
    parser.add_argument("--plot", metavar="FILE", help="write the distribution plot (PNG)")
    args = parser.parse_args()
    samples = measure(args.admissions, args.window)
    print(table(figures(samples)))
    if args.plot:
        plot(samples, args.plot, f"Allocate latency, {args.admissions} admissions")


if __name__ == "__main__":
    main()
