"""NodePrepareResources latency over the real unix-socket gRPC path, next to its floor.

The real gpushare-node with dra.enabled on two simulated T4s, the test API server
(resource.k8s.io/v1) and kubelet's DRA side (standins/dra_node.py). Claims of
1 GiB each are made and allocated once, as kube-scheduler would, from the slice the
daemon published. Then, round after round, the bench calls the daemon's DRA service
as kubelet does: NodePrepareResources of a batch (1 claim, then 16), timed, then
NodeUnprepareResources of it (not timed), so that every timed prepare reads its
claims, judges them, commits them to the ledger and writes their CDI specs anew.

The CDI specs go to a tmpfs, as ``/var/run/cdi`` is on a node; the ledger to the
node's state directory on disk, as in production.

The floor is what any prepare of N claims cannot skip, measured in the same round
from the same process: one trivial unary gRPC call on a server that does nothing
(bench/floor_server.py, the daemon's server kind) plus N reads of a claim from the
same API server over one kept-alive connection (as the daemon's client reads them).
The pure gRPC floor is reported too. Target, as Allocate's: p50 and p99 within 2x
the floor's.

Why the reads are one after the other: that is how the driver reads them, and on
this bench no correct driver does better. Reading 16 claims over 2 or 4 connections
at once took as long as one by one or longer, from the daemon (reads p50 9.1 and
8.0 ms against 8.1 and 8.0 ms measured alongside) and from a plain client (6.3 and
6.1 ms against 5.7 ms): the API server stand-in and the clients share 2 cores, so
nothing overlaps. Where the floor differs from a driver it errs low: its reads are
made in the API server's own process (8 to 60 us a read faster than from another
process, measured interleaved), their JSON is not decoded, and its call carries no
claims.

Run alone: ``.venv/bin/python -m bench.dra_prepare_latency [--quick]``; it is section
12 of ``bench/run``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import grpc
import urllib3

from bench.kubelet_client import FloorServer
from bench.report import Figure, machine_lines, table
from bench.stats import Summary
from nodemgr.kubelet.api import dra_v1_pb2, dra_v1_pb2_grpc
from standins.dra_node import DraCluster

RATIO_TARGET = 2.0
BATCHES = (1, 16)
WARMUP_ROUNDS = 5
ROUNDS_FULL, ROUNDS_QUICK = 1000, 30  # p99 of 1000: the 10th slowest, not the 2nd


@dataclass
class Samples:
    """Seconds, per batch size: prepare calls, composite floors; and the gRPC floor."""

    prepare: dict[int, list[float]]
    floor: dict[int, list[float]]
    grpc_floor: list[float]
    refused: int  # claims a prepare refused (must be 0)


def _claims(cluster: DraCluster, count: int, prefix: str) -> list[dra_v1_pb2.Claim]:
    claims = []
    for i in range(count):
        name = f"{prefix}{i}"
        cluster.claimed_pod(f"pod-{name}", name, {"memory": "1Gi"})
        uid = cluster.claim(name)["metadata"]["uid"]
        claims.append(dra_v1_pb2.Claim(namespace="ns", uid=uid, name=name))
    return claims


def measure(rounds: int) -> Samples:
    # The CDI directory on a tmpfs, as /var/run/cdi is on a node.
    cdi_dir = tempfile.mkdtemp(
        prefix="gs-cdi-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    cluster = DraCluster(cdi_dir=cdi_dir)
    floor = channel = None
    http = urllib3.PoolManager(maxsize=1)
    try:
        cluster.start()
        socket = os.path.join(cluster.node.root, "plugins", cluster.driver, "dra.sock")
        channel = grpc.insecure_channel(f"unix://{socket}")
        stub = dra_v1_pb2_grpc.DRAPluginStub(channel)
        floor = FloorServer(os.path.join(cluster.node.root, "floor.sock"))
        batches = {size: _claims(cluster, size, f"b{size}-") for size in BATCHES}
        headers = {"Authorization": f"Bearer {cluster.api.token}"}
        base = f"{cluster.api.url}/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/"
        samples = Samples({s: [] for s in BATCHES}, {s: [] for s in BATCHES}, [], 0)
        for round_ in range(WARMUP_ROUNDS + rounds):
            keep = round_ >= WARMUP_ROUNDS
            for size, claims in batches.items():
                started = time.perf_counter()
                floor.call()
                for claim in claims:
                    http.request("GET", base + claim.name, headers=headers)
                floor_s = time.perf_counter() - started
                request = dra_v1_pb2.NodePrepareResourcesRequest(claims=claims)
                started = time.perf_counter()
                answer = stub.NodePrepareResources(request, timeout=45)
                prepare_s = time.perf_counter() - started
                refused = sum(1 for entry in answer.claims.values() if entry.error)
                stub.NodeUnprepareResources(
                    dra_v1_pb2.NodeUnprepareResourcesRequest(claims=claims), timeout=45
                )
                if keep:
                    samples.prepare[size].append(prepare_s)
                    samples.floor[size].append(floor_s)
                    samples.refused += refused + len(claims) - len(answer.claims)
            if keep:
                samples.grpc_floor.append(floor.call())
        return samples
    finally:
        http.clear()
        if channel is not None:
            channel.close()
        if floor is not None:
            floor.close()
        cluster.close()
        shutil.rmtree(cdi_dir, ignore_errors=True)


def figures(samples: Samples) -> list[Figure]:
    us = 1e6
    out = []
    grpc_floor = Summary.of([s * us for s in samples.grpc_floor])
    for size in BATCHES:
        prepare = Summary.of([s * us for s in samples.prepare[size]])
        floor = Summary.of([s * us for s in samples.floor[size]])
        p50, p99 = prepare.p50 / floor.p50, prepare.p99 / floor.p99
        what = f"NodePrepareResources, {size} claim(s)"
        out += [
            Figure(f"dra_prepare_{size}_p50_us", prepare.p50, f"{what}, p50 (us)"),
            Figure(f"dra_prepare_{size}_p99_us", prepare.p99, f"{what}, p99 (us)"),
            Figure(f"dra_floor_{size}_p50_us", floor.p50,
                   f"floor: gRPC call + {size} claim read(s), p50 (us)"),
            Figure(f"dra_floor_{size}_p99_us", floor.p99, "floor p99 (us)"),
            Figure(f"dra_prepare_{size}_p50_ratio", p50, f"prepare {size} p50 / floor p50",
                   target=f"<= {RATIO_TARGET:g}", met=p50 <= RATIO_TARGET),
            Figure(f"dra_prepare_{size}_p99_ratio", p99, f"prepare {size} p99 / floor p99",
                   target=f"<= {RATIO_TARGET:g}", met=p99 <= RATIO_TARGET),
        ]  # fmt: skip
    out += [
        Figure("dra_grpc_floor_p99_us", grpc_floor.p99, "trivial unary gRPC call p99 (us)"),
        Figure("dra_prepare_refused", samples.refused, "claims refused or left out (must be 0)",
               target="0", met=samples.refused == 0),
    ]  # fmt: skip
    return out


def run(quick: bool) -> list[Figure]:
    return figures(measure(ROUNDS_QUICK if quick else ROUNDS_FULL))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{ROUNDS_QUICK} rounds")
    found = run(parser.parse_args(argv).quick)
    print(table(found))
    print()
    for line in machine_lines(found):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
