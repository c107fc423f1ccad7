"""Allocate latency with the Kubernetes pod cache empty, then holding 5,000 pods.

With the Kubernetes integration the daemon finds the container being
admitted in its local cache of the pods bound to the node (one watch; no API
call on the Allocate path). The cache's size must not show in Allocate: the
allocator only looks at pending pods that ask for a shared GPU resource, a
list rebuilt once per cache change, not once per call.

The real gpushare-node on 8 simulated H200 cards talks to the test API server
(tests/harness/apiserver_sim.py, the real REST and watch protocol). Phase
"empty": pods of 2 GiB + 1 % are created pending (as the scheduler binds
them), then admitted the way kubelet does (bench/kubelet_client.py: per
resource GetPreferredAllocation then Allocate, each timed) and marked Running,
which is a cache change per admission, as on a real node. Phase "5000": the
same after 5,000 running pods bound to the node were added to the API server
(and so to the daemon's cache). Reported: p50/p99 of Allocate in each phase
and their ratios (5000 / empty); 1.0 means unchanged.

Run: ``.venv/bin/python -m bench.kube_cache_latency [--admissions 300] [--cached-pods 5000]``
"""

from __future__ import annotations

import argparse
import time

from bench.kubelet_client import DeviceManager
from bench.nodes import h200_node, node_name, plugin_socket
from bench.report import Figure, table
from bench.stats import Summary
from nodemgr.domain.deviceids import ResourceKind
from tests.harness.apiserver_sim import TestApiServer
from tests.harness.daemon_proc import CORE, MEMORY
from tests.harness.kubelet_sim import TestKubelet

POD = {MEMORY: 2, CORE: 1}
NAMESPACE = "bench"
BATCH = 50  # pods created pending at once, then admitted one by one
WINDOW = 300  # pods held at most; the oldest is removed past that (see allocate_latency)
TARGET_RATIO = 1.25  # "unchanged", with room for this 2-core machine's noise


def _admit_phase(api, client, node: str, prefix: str, admissions: int) -> list[float]:
    """Seconds of each Allocate call for ``admissions`` pods created pending, then admitted."""
    client.timings.clear()
    done = 0
    while done < admissions:
        names = [f"{prefix}-{done + i}" for i in range(min(BATCH, admissions - done))]
        for name in names:
            api.add_pod(
                NAMESPACE,
                name,
                node,
                containers=[{"name": "main", "requests": {k: str(v) for k, v in POD.items()}}],
            )
        time.sleep(1.0)  # the daemon's watch has them before kubelet admits them
        for name in names:
            client.admit(name, dict(POD))
            api.set_pod_phase(NAMESPACE, name, "Running")
            if client.pods > WINDOW:
                client.remove_oldest()
        done += len(names)
    return list(client.timings["Allocate"])


def measure(admissions: int, cached_pods: int) -> dict[str, list[float]]:
    api = TestApiServer(history_size=cached_pods + 10 * admissions)
    api.start()
    node = h200_node(
        kubelet={"reconcile_interval_seconds": 1, "allocation_grace_seconds": 2}, api=api
    )
    name = node_name(node)
    kubelet = TestKubelet(node.device_plugin_dir, node.pod_resources_socket)
    kubelet.start()
    node.start()
    client = None
    try:
        devices = {r: kubelet.wait_for_resource(r, timeout=30) for r in (MEMORY, CORE)}
        client = DeviceManager(
            {
                MEMORY: plugin_socket(node, ResourceKind.MEMORY),
                CORE: plugin_socket(node, ResourceKind.CORE),
            },
            {r: [d.id for d in listed if d.healthy] for r, listed in devices.items()},
        )
        _admit_phase(api, client, name, "warmup", BATCH)
        empty = _admit_phase(api, client, name, "empty", admissions)
        for i in range(cached_pods):
            api.add_pod(
                "running",
                f"r{i}",
                name,
                containers=[{"name": "main", "requests": {MEMORY: "1"}}],
                phase="Running",
            )
        time.sleep(3.0)  # the watch delivers them
        full = _admit_phase(api, client, name, "full", admissions)
        return {"empty": empty, "full": full, "log": [node.log()]}
    finally:
        if client is not None:
            client.close()
        node.cleanup()
        kubelet.stop()
        api.stop()


def figures(samples: dict, cached_pods: int) -> list[Figure]:
    us = 1e6
    empty = Summary.of([s * us for s in samples["empty"]])
    full = Summary.of([s * us for s in samples["full"]])
    p99_ratio = full.p99 / empty.p99
    return [
        Figure("kube_allocate_p50_us_empty_cache", empty.p50, "Allocate p50, pod cache empty (us)"),
        Figure("kube_allocate_p99_us_empty_cache", empty.p99, "Allocate p99, pod cache empty (us)"),
        Figure(
            f"kube_allocate_p50_us_{cached_pods}_pods",
            full.p50,
            f"Allocate p50, {cached_pods} pods cached (us)",
        ),
        Figure(
            f"kube_allocate_p99_us_{cached_pods}_pods",
            full.p99,
            f"Allocate p99, {cached_pods} pods cached (us)",
        ),
        Figure(
            "kube_cache_allocate_p50_ratio",
            full.p50 / empty.p50,
            f"Allocate p50 with {cached_pods} pods / empty",
        ),
        Figure(
            "kube_cache_allocate_p99_ratio",
            p99_ratio,
            f"Allocate p99 with {cached_pods} pods / empty",
            target=f"<= {TARGET_RATIO:g} (unchanged)",
            met=p99_ratio <= TARGET_RATIO,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--admissions", type=int, default=300)
    parser.add_argument("--cached-pods", type=int, default=5000)
    args = parser.parse_args()
    samples = measure(args.admissions, args.cached_pods)
    print(table(figures(samples, args.cached_pods)))
    print(f"pod identity used: {samples['log'][0].count('ALIYUN_COM_GPU_MEM_POD=')} Allocate(s)")


if __name__ == "__main__":
    main()
