"""Size and build time of the memory device list, 8 x 141 GiB (H200), by memory unit.

kubelet reads ListAndWatch with gRPC's default 4 MiB receive limit; a larger
message is dropped and the resource's devices are lost to the node. The
memory resource has one device per unit of every card, so the unit decides
the size. For each unit, this builds the message the daemon really sends
(the servicer's first ListAndWatch answer, on an Allocator over the cards,
with each card's NUMA node as an H200 board reports it), takes its
``ByteSize()`` and times the build (device list, message, serialisation). It
also checks the daemon's size formula (``memory_device_list_bytes``, what
start-up uses to refuse a unit) against every real message, sizes the
worst case the daemon must allow for (every device Unhealthy, as when a
card's MPS is down), and starts the real daemon with a 1 MiB unit to see it
refuse (exit 2, naming the smallest safe unit).

The smallest safe unit is the smallest whose worst case stays within the
daemon's margin, MAX_LIST_BYTES (1 MiB, a quarter of kubelet's limit).

Run: ``.venv/bin/python -m bench.listandwatch_size``
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, replace

from bench.nodes import H200_CARDS, h200_node
from bench.report import Figure, table
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.config.loading import settings_from_mapping
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.inventory import Card
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2 as dp
from nodemgr.kubelet.devicelists import (
    MAX_LIST_BYTES,
    memory_device_list_bytes,
    smallest_safe_memory_unit_mib,
)
from nodemgr.kubelet.servicer import HEALTHY, UNHEALTHY, DevicePluginServicer

UNITS_MIB = (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1)
KUBELET_LIMIT_BYTES = 4 * 1024 * 1024  # gRPC's default max receive message size


@dataclass(frozen=True)
class Row:
    unit_mib: int
    devices: int
    message_bytes: int  # the message as sent, every device Healthy
    worst_bytes: int  # every device Unhealthy: what the daemon must allow for
    build_ms: float  # median over the repeats

    @property
    def safe(self) -> bool:
        return self.worst_bytes <= MAX_LIST_BYTES


def build(
    cards: list[Card], unit_mib: int, unhealthy: bool = False
) -> tuple[dp.ListAndWatchResponse, float]:
    """The first ListAndWatch message the daemon's servicer sends, and seconds to build it."""
    root = tempfile.mkdtemp(prefix="gs-law-", dir="/tmp")
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
                "resources": {"memory_unit_mib": unit_mib},
            }
        )
        ledger = Ledger(settings.state_dir)
        allocator = Allocator(settings, cards, ledger)
        if unhealthy:  # what a card whose MPS is down looks like to kubelet
            for card in cards:
                allocator.set_card_problem(card.uuid, "MPS down (bench)")
        servicer = DevicePluginServicer(allocator, ResourceKind.MEMORY, threading.Event())
        return asyncio.run(_first_message(servicer))
    finally:
        if ledger is not None:
            ledger.close()
        shutil.rmtree(root, ignore_errors=True)


async def _first_message(
    servicer: DevicePluginServicer,
) -> tuple[dp.ListAndWatchResponse, float]:
    """The stream's first message, as the plugin loop serves it, and seconds to build it."""
    started = time.perf_counter()
    stream = servicer.ListAndWatch(dp.Empty(), None)
    try:
        message = await anext(stream)
        message.SerializeToString()  # gRPC serialises what the servicer yields
        return message, time.perf_counter() - started
    finally:
        await stream.aclose()


def measure(units: tuple[int, ...] = UNITS_MIB, repeats: int = 3) -> list[Row]:
    rows = []
    for unit in units:
        times = []
        # One build of a million-device list takes seconds: repeat only smaller ones.
        for _ in range(repeats if unit >= 16 else 1):
            message, seconds = build(H200_CARDS, unit)
            times.append(seconds)
        size = message.ByteSize()
        formula = memory_device_list_bytes(H200_CARDS, unit, HEALTHY)
        if formula != size:
            raise AssertionError(f"{unit} MiB: the daemon's size formula says {formula}, "
                                 f"the real message has {size} bytes")  # fmt: skip
        rows.append(
            Row(
                unit_mib=unit,
                devices=len(message.devices),
                message_bytes=size,
                worst_bytes=memory_device_list_bytes(H200_CARDS, unit, UNHEALTHY),
                build_ms=statistics.median(times) * 1000,
            )
        )
    return rows


def check_smallest_safe_unit() -> int:
    """The daemon's smallest safe unit, confirmed on real (all Unhealthy) messages."""
    safe = smallest_safe_memory_unit_mib(H200_CARDS)
    if safe is None:
        raise AssertionError("no memory unit fits 8 H200 cards")
    fits = build(H200_CARDS, safe, unhealthy=True)[0].ByteSize()
    too_big = build(H200_CARDS, safe - 1, unhealthy=True)[0].ByteSize() if safe > 1 else None
    if fits > MAX_LIST_BYTES or (too_big is not None and too_big <= MAX_LIST_BYTES):
        raise AssertionError(f"smallest safe unit {safe} MiB: {fits} / {too_big} bytes")
    return safe


@dataclass(frozen=True)
class Refusal:
    exit_code: int
    output: str
    expected_unit_mib: int  # the smallest safe unit for the daemon's own cards

    @property
    def names_the_unit(self) -> bool:
        return f"use {self.expected_unit_mib} MiB or more" in self.output


def daemon_refusal(unit_mib: int = 1) -> Refusal:
    """Start the real daemon on the 8 H200 cards with ``unit_mib``; how it refused."""
    # The simulated backend reports no NUMA node: its list is a little smaller
    # than a real H200 board's, and so is the unit the daemon names.
    cards = [replace(card, numa_node=None) for card in H200_CARDS]
    expected = smallest_safe_memory_unit_mib(cards)
    node = h200_node(resources={"memory_unit_mib": unit_mib})
    try:
        node.start()
        code = node.wait(60)
        return Refusal(code, node.log(), expected)
    except subprocess.TimeoutExpired:
        return Refusal(-1, "the daemon did not exit within 60 s:\n" + node.log(), expected)
    finally:
        node.cleanup()


def figures(rows: list[Row], safe_unit: int, refusal: Refusal) -> list[Figure]:
    by_unit = {row.unit_mib: row for row in rows}
    out = []
    gib = by_unit.get(1024)
    if gib is not None:
        out += [
            Figure(
                "listandwatch_bytes_8x141g_gib",
                gib.message_bytes,
                "ListAndWatch bytes, 8x141 GiB at 1 GiB units",
                target=f"<= {MAX_LIST_BYTES} (daemon margin)",
                met=gib.worst_bytes <= MAX_LIST_BYTES,
            ),
            Figure(
                "listandwatch_build_ms_8x141g_gib",
                gib.build_ms,
                "ListAndWatch build ms at 1 GiB units",
            ),
        ]
    for row in rows:
        if row.unit_mib != 1024:
            out.append(
                Figure(
                    f"listandwatch_bytes_8x141g_{row.unit_mib}mib",
                    row.message_bytes,
                    f"ListAndWatch bytes at {row.unit_mib} MiB units",
                )
            )
    smallest = by_unit[min(by_unit)]
    out.append(
        Figure(
            f"listandwatch_build_ms_8x141g_{smallest.unit_mib}mib",
            smallest.build_ms,
            f"ListAndWatch build ms at {smallest.unit_mib} MiB units",
        )
    )
    pow2 = [row.unit_mib for row in rows if row.safe]
    out.append(
        Figure(
            "smallest_safe_unit_mib_8x141g",
            safe_unit,
            "smallest safe memory unit, 8x141 GiB (MiB)",
            note=f"smallest power of two in the table: {min(pow2)} MiB" if pow2 else "",
        )
    )
    out.append(
        Figure(
            "unsafe_unit_exit_code",
            refusal.exit_code,
            "daemon exit code with a 1 MiB unit",
            target="2, naming the safe unit",
            met=refusal.exit_code == 2 and refusal.names_the_unit,
            note="" if refusal.names_the_unit else f"daemon output: {refusal.output.strip()}",
        )
    )
    return out


def print_rows(rows: list[Row]) -> None:
    print(f"{'unit MiB':>8} {'devices':>9} {'bytes':>11} {'worst bytes':>11} "
          f"{'of 4 MiB':>8} {'build ms':>9} safe")  # fmt: skip
    for r in rows:
        print(
            f"{r.unit_mib:>8} {r.devices:>9} {r.message_bytes:>11} {r.worst_bytes:>11} "
            f"{r.worst_bytes / KUBELET_LIMIT_BYTES:>8.1%} {r.build_ms:>9.1f} "
            f"{'yes' if r.safe else 'no'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = measure(UNITS_MIB, args.repeats)
    print_rows(rows)
    print(table(figures(rows, check_smallest_safe_unit(), daemon_refusal())))


if __name__ == "__main__":
    main()
