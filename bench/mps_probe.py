"""What the MPS health checks cost: NVIDIA's real control binary next to the stand-in.

The supervisor asks each card's control daemon for its servers by running the
control binary in client mode (``get_server_list``). Two measurements, each with
the stand-in (standins/fakes, a Python script) and with NVIDIA's
``nvidia-cuda-mps-control`` (535, installed by scripts/setup-real-parts; its
control daemon runs without a GPU):

- one probe: CPU time of the child processes per ``CardDaemon.probe()`` (what
  the daemon's reaped children cost; ``RUSAGE_CHILDREN``) and its wall time, over
  ``probes`` probes of one control daemon;
- idle: the daemon's child-process CPU over ``seconds`` on an 8-card node at the
  production cadence, adapter off, nothing admitted (the target: < 0.5 %
  of a core with the real binary).

Run: ``.venv/bin/python -m bench.mps_probe [--probes 50] [--seconds 20]``
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import tempfile
import time

from bench.footprint import CpuWindow
from bench.nodes import h200_node
from bench.report import Figure, machine_lines, skipped, table
from mps import CardDaemon
from standins import real_parts
from standins.daemon_proc import CORE, MEMORY, MPS_STANDIN
from standins.kubelet_sim import TestKubelet

IDLE_TARGET_PERCENT = 0.5


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def probe_cost(binary: str, probes: int) -> tuple[float, float]:
    """(child CPU ms per probe, wall ms p50) of ``probes`` probes of one control daemon."""
    root = tempfile.mkdtemp(prefix="gs-probe-", dir="/tmp")
    daemon = CardDaemon("GPU-bench", binary, f"{root}/pipe", f"{root}/log", 5.0)
    daemon.start()
    try:
        walls = []
        before = _children_cpu_seconds()
        for _ in range(probes):
            started = time.monotonic()
            health = daemon.probe()
            walls.append(time.monotonic() - started)
            if not health.ok:
                raise RuntimeError(f"the control daemon of {binary} is {health.state}: {health}")
        cpu = _children_cpu_seconds() - before
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 1000 * cpu / probes, 1000 * statistics.median(walls)


def idle_children_percent(binary: str, seconds: float) -> float:
    """The daemon's child-process CPU (% of a core) on an idle 8-card node."""
    node = h200_node(production_intervals=True, control_binary=binary)
    kubelet = TestKubelet(node.device_plugin_dir, node.pod_resources_socket)
    kubelet.start()
    node.start()
    try:
        for resource_name in (MEMORY, CORE):
            kubelet.wait_for_resource(resource_name, timeout=60)
        node.wait_for(lambda: "ready: " in node.log(), timeout=60, what="READY")
        window = CpuWindow(node.process.pid)
        time.sleep(seconds)
        return window.stop().children_cpu_percent
    finally:
        node.cleanup()
        kubelet.stop()


def run(probes: int, seconds: float) -> list[Figure]:
    real = real_parts.find()
    binaries = {"standin": MPS_STANDIN}
    if isinstance(real, real_parts.RealParts):
        binaries["real"] = real.mps_control
    figures = []
    for kind, binary in binaries.items():
        cpu_ms, wall_ms = probe_cost(binary, probes)
        figures += [
            Figure(f"mps_probe_cpu_ms_{kind}", cpu_ms, f"one MPS probe, child CPU ms ({kind})"),
            Figure(f"mps_probe_wall_ms_{kind}", wall_ms, f"one MPS probe, wall ms p50 ({kind})"),
        ]
    if "real" not in binaries:
        why = f"NVIDIA's control binary is not available here: {real}"
        return [
            *figures,
            skipped("mps_probe_cpu_ms_real", "one MPS probe, child CPU ms (real)", why),
            skipped(
                "idle_children_cpu_percent_real",
                "idle CPU, MPS probes, 8 cards (real binary)",
                why,
                target=f"< {IDLE_TARGET_PERCENT:g} %",
            ),
        ]
    idle_percent = idle_children_percent(binaries["real"], seconds)
    return [
        *figures,
        Figure(
            "idle_children_cpu_percent_real",
            idle_percent,
            f"idle CPU, MPS probes, 8 cards, real binary (% of a core, {seconds:g} s)",
            target=f"< {IDLE_TARGET_PERCENT:g} %",
            met=idle_percent < IDLE_TARGET_PERCENT,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--probes", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=20)
    args = parser.parse_args()
    figures = run(args.probes, args.seconds)
    print(table(figures))
    print("\n".join(machine_lines(figures)))


if __name__ == "__main__":
    main()
