"""Every benchmark in one run: a table per section, then ``name=value`` lines.

What ``bench/run`` runs (it sets up the venv and runc first). Sections, each
in its own module with what it measures and why:

1. Allocate latency next to a floor (bench/allocate_latency.py), plus the
   distribution plot;
2. ListAndWatch size by memory unit, the smallest safe unit and the daemon's
   refusal of an unsafe one (bench/listandwatch_size.py);
3. footprint, idle and busy, on a full node (bench/footprint.py), with the
   Kubernetes adapter on (as deployed; a test API server) and off;
4. restart: daemon start to READY=1, re-registration after kubelet restarts
   (bench/restart.py, on the same full node, adapter on);
5. enforcement reaction (bench/enforcement_reaction.py, real runc);
6. runtime hook overhead (bench/hook_overhead.py, real runc);
7. Allocate with the Kubernetes pod cache empty vs holding 5,000 pods
   (bench/kube_cache_latency.py, test API server);
8. SIGTERM to exit with kubelet streaming and with every MPS control daemon
   hung (bench/shutdown.py);
9. the cluster side (bench/cluster_sim.py): pods refused at admission with node
   totals only vs with gpushare-scheduler, filter/bind p99, extender RSS;
10. the scale curve (bench/scale.py): Allocate p99 ratio, idle CPU, RSS and CPU per
    admission on 1, 8, 16 cards x 0, 384, 1,000 allocations (a daemon per point, their
    Allocate phases interleaved), plotted next to the Allocate plot;
11. MPS probe cost, NVIDIA's control binary next to the stand-in, and the idle
    CPU of an 8-card node's probes with the real binary (bench/mps_probe.py);
12. the DRA front door: NodePrepareResources of 1 and of 16 claims next to their
    floor, a gRPC call and the claims' reads from the API server
    (bench/dra_prepare_latency.py; alone: ``python -m bench.dra_prepare_latency``).

A figure whose feature is not built is ``absent``; one this machine cannot
measure (no runc, not root) is ``skipped`` with the reason in the notes; one
whose section failed is ``failed`` (the error goes to stderr and the exit
status is 1). The figures are distributions and ratios measured in the same
run: the development machines are small and shared, single timings mislead.

Run: ``bench/run [--quick] [--plot FILE]``
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from bench import (
    allocate_latency,
    cluster_sim,
    dra_prepare_latency,
    enforcement_reaction,
    footprint,
    hook_overhead,
    kube_cache_latency,
    listandwatch_size,
    mps_probe,
    restart,
    scale,
    shutdown,
)
from bench.report import Figure, machine_lines, skipped, table
from standins import runc_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PLOT = os.path.join(REPO, "docs", "allocate_latency.png")
FAILED = "failed"


@dataclass(frozen=True)
class Settings:
    admissions: int
    law_units: tuple[int, ...]
    law_repeats: int
    idle_seconds: float
    busy_seconds: float
    restarts: int
    enforcement_runs: int
    hook_rounds: int
    kube_cache_admissions: int
    shutdown_trials: int
    cluster_quick: bool  # the cluster simulation at its small size
    adapter_off_too: bool  # footprint a second time with the Kubernetes adapter off
    scale_cards: tuple[int, ...]  # card counts of the scale curve
    scale_allocations: tuple[int, ...]  # allocation counts at each
    scale_idle_seconds: float  # idle window per point
    scale_admissions: int  # steady-state admissions per point (two Allocate calls each)
    mps_probes: int  # probes of one control daemon, per binary (bench/mps_probe.py)
    mps_idle_seconds: float  # idle window of an 8-card node with the real control binary
    dra_quick: bool  # NodePrepareResources: bench/dra_prepare_latency.py's quick round count


FULL = Settings(
    admissions=2000,
    law_units=listandwatch_size.UNITS_MIB,
    law_repeats=3,
    idle_seconds=30,
    busy_seconds=60,  # admissions/s sustained for 60 s
    restarts=5,
    enforcement_runs=40,
    hook_rounds=40,
    kube_cache_admissions=300,
    shutdown_trials=20,
    cluster_quick=False,
    adapter_off_too=True,
    scale_cards=scale.CARDS,
    scale_allocations=scale.ALLOCATIONS,
    scale_idle_seconds=10,
    # 1,200 Allocate calls a point: with 480, one point's p99 ratio moved 3x between runs.
    scale_admissions=600,
    mps_probes=50,
    mps_idle_seconds=20,
    dra_quick=False,
)
QUICK = Settings(
    admissions=300,
    law_units=tuple(u for u in listandwatch_size.UNITS_MIB if u >= 16),
    law_repeats=1,
    idle_seconds=10,
    busy_seconds=4,
    restarts=2,
    enforcement_runs=8,
    hook_rounds=8,
    kube_cache_admissions=100,
    shutdown_trials=4,
    cluster_quick=True,
    adapter_off_too=False,
    scale_cards=(1, 8),
    scale_allocations=(0, 384),
    scale_idle_seconds=5,
    scale_admissions=40,
    mps_probes=10,
    mps_idle_seconds=5,
    dra_quick=True,
)


@dataclass(frozen=True)
class Section:
    title: str
    # The names this section must report: reported as failed if it fails.
    required: tuple[str, ...]
    run: Callable[[], list[Figure]]


def machine() -> list[Figure]:
    """Where and when: figures only compare with figures from the same kind of machine."""

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "none"

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if "model name" in line), cpu)
    except OSError:
        pass
    return [
        Figure("date", datetime.date.today().isoformat(), "date"),
        Figure("machine_cores", os.cpu_count() or 0, "CPU cores", note=f"CPU: {cpu}"),
        Figure("python_version", platform.python_version(), "Python"),
        Figure("grpcio_version", version("grpcio"), "grpcio"),
        Figure("kernel", platform.release(), "Linux kernel"),
    ]


def sections(settings: Settings, plot_path: str | None) -> list[Section]:
    def latency() -> list[Figure]:
        samples = allocate_latency.measure(settings.admissions)
        if plot_path:
            allocate_latency.plot(
                samples,
                plot_path,
                f"Allocate latency over unix-socket gRPC, {samples.admissions} admissions, "
                f"8 x H200 (simulated), {datetime.date.today().isoformat()}, "
                f"{os.cpu_count()} cores, Python {platform.python_version()}",
            )
        return allocate_latency.figures(samples)

    def law() -> list[Figure]:
        rows = listandwatch_size.measure(settings.law_units, settings.law_repeats)
        listandwatch_size.print_rows(rows)
        safe = listandwatch_size.check_smallest_safe_unit()
        return listandwatch_size.figures(rows, safe, listandwatch_size.daemon_refusal())

    def deployed_node() -> list[Figure]:
        # The daemon as deployed: its Kubernetes adapter on (a test API server holds
        # the pods). Restarts come before the busy phase, whose pods the ledger keeps
        # until their grace ends: READY is timed with exactly the 384 allocations.
        binary_kind, binary = footprint.mps_control_binary()
        full = footprint.full_node(kubernetes=True, control_binary=binary)
        try:
            footprint.settle(full)  # the admissions' after-effects (writes, reconcile) end
            idle, events_per_s = footprint.idle(full, settings.idle_seconds)
            ready_s, ready_phases = restart.daemon_restarts(full, settings.restarts)
            reregister_s = restart.kubelet_restarts(full, settings.restarts)
            allocations, mismatch = restart.ledger_allocations(full)
            busy = footprint.busy(full, settings.busy_seconds)
        finally:
            full.close()
        used = Figure("mps_control_binary", binary_kind, "MPS control binary the node ran")
        return [
            used,
            *footprint.figures(full, idle, events_per_s, busy),
            *restart.figures(ready_s, ready_phases, reregister_s, allocations, mismatch),
        ]

    def plain_node() -> list[Figure]:
        # The same with the adapter off: what the device plugin alone costs.
        full = footprint.full_node(
            kubernetes=False, control_binary=footprint.mps_control_binary()[1]
        )
        try:
            footprint.settle(full)
            idle, events_per_s = footprint.idle(full, settings.idle_seconds)
            busy = footprint.busy(full, settings.busy_seconds)
        finally:
            full.close()
        return footprint.figures(full, idle, events_per_s, busy, suffix="_no_kube")

    no_runc = runc_env.missing()

    def enforcement() -> list[Figure]:
        if no_runc:
            return [skipped("enforcement_p99_ms", "over quota to killed, p99 (ms)", no_runc)]
        return enforcement_reaction.figures(enforcement_reaction.measure(settings.enforcement_runs))

    def hook() -> list[Figure]:
        if no_runc:
            return [skipped("hook_overhead_p50_ms", "hook adds to creation (ms)", no_runc)]
        return hook_overhead.figures(hook_overhead.measure(settings.hook_rounds))

    def kube_cache() -> list[Figure]:
        samples = kube_cache_latency.measure(settings.kube_cache_admissions, 5000)
        return kube_cache_latency.figures(samples, 5000)

    return [
        Section(
            "1. Allocate latency vs a trivial gRPC call (same run, same socket kind)",
            ("allocate_p50_us", "allocate_p99_us", "floor_p99_us", "allocate_p99_ratio"),
            latency,
        ),
        Section(
            "2. ListAndWatch size, 8 x 141 GiB (H200)",
            ("listandwatch_bytes_8x141g_gib", "smallest_safe_unit_mib_8x141g"),
            law,
        ),
        Section(
            "3-4. Footprint and restart, 8 x H200 with 384 allocations (8 cards x 48 clients), "
            "Kubernetes adapter on (test API server)",
            ("idle_rss_mib", "idle_cpu_percent", "ready_seconds_384"),
            deployed_node,
        ),
        *(
            [
                Section(
                    "3b. Footprint with the Kubernetes adapter off (device plugin alone)",
                    (),
                    plain_node,
                )
            ]  # fmt: skip
            if settings.adapter_off_too
            else []
        ),
        Section("5. Enforcement reaction (real runc)", ("enforcement_p99_ms",), enforcement),
        Section("6. Runtime hook overhead (real runc)", ("hook_overhead_p50_ms",), hook),
        Section(
            "7. Allocate with the Kubernetes pod cache empty vs 5,000 pods cached",
            ("kube_cache_allocate_p99_ratio",),
            kube_cache,
        ),
        Section(
            "8. SIGTERM to exit: kubelet streaming, and every MPS control daemon hung",
            ("shutdown_p99_ms",),
            partial(_shutdown, settings),
        ),
        Section(
            "9. The cluster side: scheduling with node totals only vs with gpushare-scheduler, "
            "filter and bind cost, extender memory",
            (),
            partial(cluster_sim.run, settings.cluster_quick),
        ),
        Section(
            "10. Scale: Allocate p99 ratio, idle CPU and RSS by cards and allocations",
            ("scale_flat_in_allocations", "scale_linear_in_cards"),
            partial(_scale_curve, settings, plot_path),
        ),
        Section(
            "11. MPS health probes: NVIDIA's control binary next to the stand-in",
            ("idle_children_cpu_percent_real",),
            partial(mps_probe.run, settings.mps_probes, settings.mps_idle_seconds),
        ),
        Section(
            "12. DRA: NodePrepareResources of 1 and 16 claims vs a gRPC call and the claims' reads",
            ("dra_prepare_1_p99_ratio", "dra_prepare_16_p99_ratio"),
            partial(dra_prepare_latency.run, settings.dra_quick),
        ),
    ]


def _shutdown(settings: Settings) -> list[Figure]:
    return shutdown.figures(shutdown.measure(settings.shutdown_trials))


def _scale_curve(settings: Settings, plot_path: str | None) -> list[Figure]:
    points = scale.measure(
        settings.scale_cards,
        settings.scale_allocations,
        settings.scale_idle_seconds,
        settings.scale_admissions,
    )
    if plot_path:  # next to the Allocate latency plot
        path = os.path.join(os.path.dirname(plot_path), scale.PLOT_NAME)
        title = scale.title(settings.scale_idle_seconds, settings.scale_admissions)
        wrote = scale.plot(points, path, title)
        print(f"scale plot: {os.path.relpath(path, REPO) if wrote else 'none, no matplotlib'}")
    return scale.figures(points)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of about 7 minutes")
    parser.add_argument(
        "--plot",
        default=DEFAULT_PLOT,
        metavar="FILE",
        help=f"Allocate latency plot, PNG (default {os.path.relpath(DEFAULT_PLOT, REPO)}; "
        f"the scale curve goes next to it as {scale.PLOT_NAME}; '' for neither)",
    )
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    started = time.monotonic()
    figures = machine()
    print(table(figures), flush=True)
    failed = []
    for section in sections(settings, args.plot or None):
        print(f"\n== {section.title}", flush=True)
        section_started = time.monotonic()
        try:
            found = section.run()
        except Exception:
            traceback.print_exc()
            failed.append(section.title)
            found = [Figure(name, FAILED, name, note="the section failed: see stderr")
                     for name in section.required]  # fmt: skip
        print(table(found))
        print(f"({time.monotonic() - section_started:.0f} s)", flush=True)
        figures += found
    figures += [
        Figure("bench_quick", int(args.quick), "quick run"),
        Figure("bench_seconds", round(time.monotonic() - started), "seconds, whole run"),
    ]
    if args.plot:
        print(f"\nplot: {os.path.relpath(args.plot, REPO)}")
    print()
    for line in machine_lines(figures):
        print(line)
    if failed:
        print(f"failed sections: {'; '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def required_names() -> list[str]:
    """Every name the suite reports, in order (checked by tests/bench/test_bench.py)."""
    return [name for s in sections(QUICK, None) for name in s.required]


def value_of(lines: list[str], name: str) -> str:
    """The value of ``name`` in ``name=value`` lines (for tests and scripts)."""
    for line in lines:
        key, sep, value = line.partition("=")
        if sep and key == name:
            return value
    raise KeyError(name)


if __name__ == "__main__":
    sys.exit(main())
