"""CPU time of the allocation state's upkeep, in-process, by allocations held and cards.

What ``bench.scale``'s steady phase makes the daemon do, without the daemon around
it (no gRPC, no other threads, no machine noise beyond this process): an
Allocator over simulated H200 cards (``scale``'s unit of 136 MiB), filled with
memory-only pods of one unit that kubelet's record reports (confirmed), then
steady-state admissions of one unit + 1 % (GetPreferredAllocation and Allocate
per resource, kubelet offering every free ID) that kubelet's record never shows,
so each is released by a reconcile once its grace (2 s) ran out. The clock moves
0.25 s per admission and a reconcile (against the same record object, as the
PodResources client hands it back while kubelet's answer is unchanged) runs every
``ADMISSIONS_PER_RECONCILE`` admissions: ``scale``'s 8 admissions a second over
two daemons, reconcile every second. Each admission's pod leaves kubelet after
``WINDOW`` newer ones.

It reports the process CPU time (``time.process_time``) per admission and per
reconcile, and their sum per admission (the admission plus its share of the
reconciles), at each allocation count, and how that grows from none to the most.

Run: ``.venv/bin/python -m bench.upkeep [--cards 1,8] [--allocations 0,384,1000]
[--admissions 400]``
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections import deque
from dataclasses import dataclass

from bench.nodes import h200_cards
from bench.report import Figure, table
from bench.scale_figures import MEMORY_UNIT_MIB
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.config.loading import settings_from_mapping
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import ContainerRef
from nodemgr.inventory import Card

MEM, CORE = ResourceKind.MEMORY, ResourceKind.CORE
CARDS = (1, 8)
ALLOCATIONS = (0, 384, 1000)
SECONDS_PER_ADMISSION = 0.25
ADMISSIONS_PER_RECONCILE = 4
GRACE_SECONDS = 2.0
WINDOW = 36
WARMUP_ADMISSIONS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Point:
    cards: int
    allocations: int
    admission_ms: float  # the allocator's preferred + Allocate for both resources
    reconcile_ms: float  # per reconcile
    per_admission_ms: float  # an admission and its share of the reconciles


class Kubelet:
    """What kubelet hands out: the free IDs it offers, the pods it reports."""

    def __init__(self, allocator: Allocator) -> None:
        self.allocator = allocator
        self.taken: set[str] = set()
        self.record: dict[ContainerRef, dict[str, list[str]]] = {}
        self.private: deque[list[str]] = deque()  # the steady pods' IDs, oldest first

    def free(self, kind: ResourceKind) -> list[str]:
        return [d.id for d in self.allocator.devices(kind) if d.healthy and d.id not in self.taken]

    def admit(
        self, request: list[tuple[ResourceKind, int]]
    ) -> tuple[dict[ResourceKind, list[str]], float]:
        """The devices each resource got, and the CPU seconds of the allocator's calls
        (kubelet's own work, listing the free IDs, left out)."""
        held, cpu = {}, 0.0
        for kind, size in request:
            free = self.free(kind)
            started = time.process_time()
            chosen = self.allocator.preferred(kind, free, [], size)
            self.allocator.allocate(kind, chosen)
            cpu += time.process_time() - started
            self.taken.update(chosen)
            held[kind] = chosen
        return held, cpu


def measure_point(cards: list[Card], allocations: int, admissions: int) -> Point:
    root = tempfile.mkdtemp(prefix="gs-upkeep-", dir="/tmp")
    ledger = None
    try:
        settings = settings_from_mapping(
            {
                "node_name": "bench",
                "state_dir": f"{root}/state",
                "run_dir": f"{root}/run",
                "gpus": {
                    "backend": "simulated",
                    "simulated": {
                        "devices": [
                            {"uuid": c.uuid, "name": c.name, "memory_mib": c.memory_mib}
                            for c in cards
                        ]
                    },
                },
                "resources": {"memory_unit_mib": MEMORY_UNIT_MIB, "placement": "spread"},
                "kubelet": {"allocation_grace_seconds": GRACE_SECONDS},
            }
        )
        clock = Clock()
        ledger = Ledger(settings.state_dir)
        allocator = Allocator(settings, cards, ledger, clock=clock, monotonic=clock)
        kubelet = Kubelet(allocator)
        name = allocator.resource_names[MEM]
        for n in range(allocations):
            held, _ = kubelet.admit([(MEM, 1)])
            kubelet.record[ContainerRef("scale", f"fill{n}", "main")] = {name: held[MEM]}
            clock.now += 0.01
        allocator.reconcile(kubelet.record)  # the fill confirmed
        admission_cpu = reconcile_cpu = 0.0
        reconciles = 0
        for n in range(WARMUP_ADMISSIONS + admissions):
            if n == WARMUP_ADMISSIONS:
                admission_cpu = reconcile_cpu = 0.0
                reconciles = 0
            held, cpu = kubelet.admit([(MEM, 1), (CORE, 1)])
            admission_cpu += cpu
            kubelet.private.append([i for ids in held.values() for i in ids])
            if len(kubelet.private) > WINDOW:
                kubelet.taken.difference_update(kubelet.private.popleft())
            clock.now += SECONDS_PER_ADMISSION
            if n % ADMISSIONS_PER_RECONCILE == ADMISSIONS_PER_RECONCILE - 1:
                started = time.process_time()
                allocator.reconcile(kubelet.record)
                reconcile_cpu += time.process_time() - started
                reconciles += 1
        held_now = allocator.allocation_count()
        if held_now < allocations:
            raise AssertionError(f"{held_now} allocations held, {allocations} expected")
        return Point(
            cards=len(cards),
            allocations=allocations,
            admission_ms=admission_cpu / admissions * 1000,
            reconcile_ms=reconcile_cpu / max(reconciles, 1) * 1000,
            per_admission_ms=(admission_cpu + reconcile_cpu) / admissions * 1000,
        )
    finally:
        if ledger is not None:
            ledger.close()
        shutil.rmtree(root, ignore_errors=True)


def figures(points: list[Point]) -> list[Figure]:
    out = []
    for p in points:
        at = f"c{p.cards}_a{p.allocations}"
        out += [
            Figure(f"upkeep_admission_cpu_ms_{at}", p.admission_ms, f"{at}: admission CPU ms"),
            Figure(f"upkeep_reconcile_cpu_ms_{at}", p.reconcile_ms, f"{at}: reconcile CPU ms"),
            Figure(
                f"upkeep_cpu_ms_per_admission_{at}",
                p.per_admission_ms,
                f"{at}: CPU ms per admission, its reconciles included",
            ),
        ]
    for cards in sorted({p.cards for p in points}):
        mine = sorted((p for p in points if p.cards == cards), key=lambda p: p.allocations)
        if len(mine) > 1 and mine[0].per_admission_ms > 0:
            out.append(
                Figure(
                    f"upkeep_growth_c{cards}",
                    mine[-1].per_admission_ms / mine[0].per_admission_ms,
                    f"{cards} card(s): CPU per admission at {mine[-1].allocations} over "
                    f"{mine[0].allocations} allocations",
                )
            )
    return out


def _counts(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cards", type=_counts, default=CARDS)
    parser.add_argument("--allocations", type=_counts, default=ALLOCATIONS)
    parser.add_argument("--admissions", type=int, default=400)
    args = parser.parse_args()
    points = []
    for count in args.cards:
        for level in args.allocations:
            point = measure_point(h200_cards(count), level, args.admissions)
            print(
                f"upkeep: {count} card(s), {level} allocations: admission "
                f"{point.admission_ms:.2f} ms, reconcile {point.reconcile_ms:.2f} ms, "
                f"per admission {point.per_admission_ms:.2f} ms CPU",
                flush=True,
            )
            points.append(point)
    print(table(figures(points)))


if __name__ == "__main__":
    main()
