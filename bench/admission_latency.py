"""Admission latency through the real daemon, as the node fills up.

Starts gpushare-node on 8 simulated 80 GiB cards and the test kubelet, then
admits pods of 1 GiB + 1 % one at a time (GetPreferredAllocation + Allocate
for both resources, over real gRPC on unix sockets) and reports the latency
distribution per band of allocations already held. A last band runs with
kubelet's PodResources API answering UNAVAILABLE: Allocate must not care.

Allocate reads nothing from the cluster (no API server, no kubelet call), so
the number of pods in the cluster cannot enter its latency; what can grow it
is the node's own allocation count, which this measures as a ratio.

Run: .venv/bin/python -m bench.admission_latency [--pods 400]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.stats import percentile
from standins.daemon_proc import CORE, MEMORY, Node
from standins.kubelet_sim import ContainerSpec, TestKubelet

CARDS = [
    {
        "uuid": f"GPU-bench{i:03d}-0000-4000-8000-000000000000",
        "name": "A100 80GB",
        "memory_mib": 81920,
    }
    for i in range(8)
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=400, help="pods to admit (max 640)")
    parser.add_argument("--band", type=int, default=100, help="pods per reported band")
    args = parser.parse_args()
    node = Node(gpus={"backend": "simulated", "simulated": {"devices": CARDS}})
    kubelet = TestKubelet(node.device_plugin_dir, node.pod_resources_socket)
    kubelet.start()
    node.start()
    try:
        for resource in (MEMORY, CORE):
            kubelet.wait_for_resource(resource, timeout=30)
        bands: list[tuple[str, list[float]]] = []
        latencies: list[float] = []
        for i in range(args.pods):
            if i and i % args.band == 0:
                bands.append((f"{i - args.band}-{i - 1} held", latencies))
                latencies = []
            if i == args.pods - args.band // 2:
                kubelet.set_pod_resources_available(False)
            started = time.perf_counter()
            result = kubelet.admit_pod("bench", f"p{i}", [ContainerSpec("c", {MEMORY: 1, CORE: 1})])
            latencies.append((time.perf_counter() - started) * 1000)
            assert result.ok, result.error
        bands.append((f"last {len(latencies)} (PodResources down for half)", latencies))
        print(f"{'allocations held':<40} {'n':>4} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8}")
        for name, values in bands:
            print(
                f"{name:<40} {len(values):>4} {statistics.median(values):>8.2f} "
                f"{percentile(values, 95):>8.2f} {max(values):>8.2f}"
            )
        first, last = statistics.median(bands[0][1]), statistics.median(bands[-1][1])
        print(f"median ratio, last band / first band: {last / first:.2f}")
    finally:
        node.cleanup()
        kubelet.stop()


if __name__ == "__main__":
    main()
