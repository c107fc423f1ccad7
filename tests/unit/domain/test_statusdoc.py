"""The status document and its table (nodemgr.domain.statusdoc): what `nodemgr status` shows.

Pins: card modes (shared / whole / idle) and their allocated memory and share;
None means unknown and is never turned into 0 (usage, health, MPS with the
daemon down); allocation rows carry pod identity, card index, quota, use,
state, containers and violations; the table has one row per card and per
allocation and says plainly when the daemon is not running.
"""

from __future__ import annotations

from types import SimpleNamespace

from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import Allocation, ContainerRef
from nodemgr.domain.statusdoc import MpsView, UsageView, build_status, render_table
from tests.harness.cards import GPU0, GPU1

CARDS = [
    SimpleNamespace(index=0, uuid=GPU0, name="Tesla T4", memory_mib=15360),
    SimpleNamespace(index=1, uuid=GPU1, name="Tesla T4", memory_mib=15360),
]


def shared(allocation_id, card, units, core, owner=None, confirmed=True):
    devices = {}
    if units:
        devices[ResourceKind.MEMORY] = tuple(f"{card}-_-{j}" for j in range(units))
    if core:
        devices[ResourceKind.CORE] = tuple(f"{card}-_-c{j}" for j in range(core))
    return Allocation(
        allocation_id,
        devices,
        units * 1024,
        created_at=1000.0,
        owner=owner,
        confirmed_at=1001.0 if confirmed else None,
    )


def whole(allocation_id, card):
    return Allocation(allocation_id, {ResourceKind.WHOLE: (card,)}, 0, created_at=1000.0)


def status(allocations, **overrides):
    arguments = dict(
        source="daemon",
        card_problems={},
        mps={GPU0: MpsView("healthy", 2), GPU1: MpsView("off")},
        usage=UsageView({GPU0: 3000}, {"a1": 1200}),
        containers={"a1": 1},
        violations={"a2": 3},
        enforcement={"action": "kill", "violations": {"memory": 3}, "kills": 2},
        daemon={"pid": 42, "started_at": 900.0, "ready": True},
    )
    arguments.update(overrides)
    return build_status("node-a", CARDS, allocations, **arguments)


def test_cards_summed_per_mode():
    doc = status(
        [
            shared("a1", GPU0, 4, 30, ContainerRef("ns", "p1", "main")),
            shared("a2", GPU0, 2, 0, confirmed=False),
            whole("w1", GPU1),
        ]
    )
    gpu0, gpu1 = doc["gpus"]
    assert (gpu0["mode"], gpu0["memory_allocated_mib"], gpu0["core_allocated_percent"]) == (
        "shared",
        6144,
        30,
    )
    assert gpu0["memory_used_mib"] == 3000 and gpu0["allocations"] == 2
    assert gpu0["mps"] == {"state": "healthy", "clients": 2, "detail": ""}
    assert (gpu1["mode"], gpu1["memory_allocated_mib"], gpu1["core_allocated_percent"]) == (
        "whole",
        15360,
        100,
    )
    assert gpu1["memory_used_mib"] == 0  # known: nothing runs there
    assert gpu0["healthy"] is True and gpu0["problem"] is None


def test_idle_card_and_problem():
    doc = status([], card_problems={GPU1: "MPS control daemon down"})
    assert [g["mode"] for g in doc["gpus"]] == ["idle", "idle"]
    assert doc["gpus"][1]["healthy"] is False
    assert doc["gpus"][1]["problem"] == "MPS control daemon down"


def test_allocation_rows():
    doc = status([shared("a1", GPU0, 4, 30, ContainerRef("ns", "p1", "main")), whole("w1", GPU1)])
    a1, w1 = doc["allocations"]
    assert a1 == {
        "id": "a1",
        "gpu": GPU0,
        "gpu_index": 0,
        "gpus": [GPU0],
        "whole": False,
        "memory_mib": 4096,
        "memory_used_mib": 1200,
        "core_percent": 30,
        "namespace": "ns",
        "pod": "p1",
        "container": "main",
        "state": "confirmed",
        "containers": 1,
        "violations": 0,
        "created_at": 1000.0,
    }
    assert (w1["whole"], w1["gpu_index"], w1["memory_mib"], w1["core_percent"]) == (
        True,
        1,
        15360,
        100,
    )
    assert (w1["pod"], w1["state"]) == (None, "pending")


def test_unknown_stays_unknown_with_the_daemon_down():
    doc = status(
        [shared("a1", GPU0, 4, 30)],
        source="ledger",
        card_problems=None,
        mps={},
        usage=None,
        enforcement=None,
        daemon=None,
    )
    gpu0 = doc["gpus"][0]
    assert gpu0["memory_used_mib"] is None and gpu0["healthy"] is None
    assert gpu0["mps"]["state"] == "unknown"
    assert doc["allocations"][0]["memory_used_mib"] is None
    table = render_table(doc, now=1010.0)
    assert "NOT running" in table
    assert "4.0G / ? / 15.0G" in table


def test_mps_disabled_is_said():
    doc = status([], mps=None)
    assert {g["mps"]["state"] for g in doc["gpus"]} == {"disabled"}


def test_table_one_row_per_card_and_allocation():
    doc = status([shared("a1", GPU0, 4, 30, ContainerRef("ns", "p1", "main")), whole("w1", GPU1)])
    lines = render_table(doc, now=1065.0).splitlines()
    assert lines[0].startswith("node node-a: gpushare-node pid 42, up 2m, ready")
    assert "3 violations, 2 kills" in lines[0]
    card_rows = [line for line in lines if line.startswith(("0 ", "1 "))]
    assert len(card_rows) == 2
    assert "shared" in card_rows[0] and "4.0G / 2.9G / 15.0G" in card_rows[0]
    assert "whole" in card_rows[1] and "off" in card_rows[1]
    pod_row = next(line for line in lines if line.startswith("ns/p1"))
    assert "main" in pod_row and "4.0G / 1.2G" in pod_row and "30%" in pod_row
    assert "confirmed" in pod_row and pod_row.endswith("1m")
    assert any(line.startswith("(not yet known)") and "whole card" in line for line in lines)


def test_table_without_allocations():
    assert render_table(status([]), now=1000.0).endswith("no allocations")
