"""The status document and its table (nodemgr.domain.statusdoc): what `nodemgr status` shows.

Pins: card modes (shared / whole / idle) and their allocated memory and share;
None means unknown and is never turned into 0 (usage, health, MPS with the
daemon down); allocation rows carry pod identity, card index, quota, use,
state, containers, violations and isolation (from the node's facts and each
card's MPS state; null with the daemon down); the table has one row per card
and per allocation with its isolation levels, the reasons below it, and says
plainly when the daemon is not running.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.isolation import NodeIsolationFacts, WatchdogFacts
from nodemgr.domain.model import Allocation, ContainerRef
from nodemgr.domain.statusdoc import MpsView, UsageView, build_status, render_table
from standins.cards import GPU0, GPU1

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
        daemon={"pid": 42, "started_at": 900.0, "ready": True, "registered": True},
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
        "isolation": None,  # no node facts given: not known
        "claim": None,  # a device plugin allocation
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


@pytest.mark.parametrize(
    ("daemon", "state"),
    [
        ({"ready": True, "registered": True}, "ready"),
        ({"ready": True, "registered": False}, "not registered with kubelet"),
        ({"ready": False, "registered": False}, "not registered with kubelet"),
        ({"ready": False, "registered": True}, "registered, waiting for MPS"),
    ],
)
def test_the_header_says_ready_only_when_registered_and_ready(daemon, state):
    """The header's state is what the daemon is now: ready only while it is registered with
    kubelet and ready; otherwise what it lacks (never "starting" for a daemon whose kubelet
    went away)."""
    info = {"pid": 42, "started_at": 900.0, **daemon}
    header = render_table(status([], daemon=info), now=1065.0).splitlines()[0]
    assert header.startswith(f"node node-a: gpushare-node pid 42, up 2m, {state}")


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


def test_table_cells_that_do_not_print_as_one_line_are_escaped():
    """A pod or container name holding a line break or a terminal escape: one row, the
    cell an escaped literal."""
    owner = ContainerRef("ns", "p1\n0    Tesla T4  whole", "main\x1b[2K")
    lines = render_table(status([shared("a1", GPU0, 4, 30, owner)]), now=1065.0).splitlines()
    [row] = [line for line in lines if line.startswith("'ns/p1")]
    assert "'ns/p1\\n0    Tesla T4  whole'" in row and "'main\\x1b[2K'" in row


def test_table_without_allocations():
    assert render_table(status([]), now=1000.0).endswith("no allocations")


KILLING = NodeIsolationFacts(WatchdogFacts(running=True, action="kill", usage_readable=True))


def test_isolation_per_allocation_follows_its_card():
    """Each allocation's isolation is computed with its own card's MPS state: healthy MPS
    and a killing watchdog give enforced memory and advisory compute; a whole card is
    exclusive; a card whose MPS is down applies no share."""
    doc = status(
        [
            shared("a1", GPU0, 4, 30, ContainerRef("ns", "p1", "main")),
            shared("a2", GPU1, 2, 10),
        ],
        mps={GPU0: MpsView("healthy", 2), GPU1: MpsView("down")},
        isolation=KILLING,
    )
    a1, a2 = (a["isolation"] for a in doc["allocations"])
    assert set(a1) == {"memory", "memory_detail", "compute", "compute_detail"}
    assert (a1["memory"], a1["compute"]) == ("enforced", "advisory")
    assert "MPS caps each process" in a1["memory_detail"]
    assert (a2["memory"], a2["compute"]) == ("enforced", "unlimited")
    assert "MPS is down" in a2["memory_detail"]
    doc = status([whole("w1", GPU1)], isolation=KILLING)
    assert doc["allocations"][0]["isolation"]["memory"] == "exclusive"


def test_isolation_does_not_claim_the_ceiling_of_a_card_with_a_problem():
    """MPS answers healthy but the card has a problem (e.g. the ceiling could not be set),
    or health is unknown: the reason does not claim the server-side ceiling."""
    allocations = [shared("a1", GPU0, 4, 30)]
    troubled = status(allocations, card_problems={GPU0: "MPS control daemon answers oddly"},
                      isolation=KILLING)  # fmt: skip
    assert "ceiling may not be set" in troubled["allocations"][0]["isolation"]["memory_detail"]
    unknown = status(allocations, card_problems=None, isolation=KILLING)
    assert "ceiling may not be set" in unknown["allocations"][0]["isolation"]["memory_detail"]


def test_isolation_with_mps_disabled_and_a_dmem_region():
    """mps.enabled false: the share is applied by nothing; a dmem region of the card is
    named (and said to be unused), one of another card is not."""
    facts = NodeIsolationFacts(KILLING.watchdog, {GPU0: "drm/0000:03:00.0/vram0"})
    doc = status([shared("a1", GPU0, 4, 30), shared("a2", GPU1, 4, 30)], mps=None,
                 isolation=facts)  # fmt: skip
    a1, a2 = (a["isolation"] for a in doc["allocations"])
    assert a1["compute"] == "unlimited" and "mps.enabled false" in a1["compute_detail"]
    assert "drm/0000:03:00.0/vram0" in a1["memory_detail"]
    assert "dmem" not in a2["memory_detail"]


def test_table_shows_isolation_levels_and_their_reasons():
    """The table has an ISOLATION MEM/CORE column (memory/compute level, "?" when not
    known) and, below, each level shown once with its reason."""
    allocations = [
        shared("a1", GPU0, 4, 30, ContainerRef("ns", "p1", "main")),
        shared("a2", GPU0, 2, 30, ContainerRef("ns", "p1", "side")),
        whole("w1", GPU1),
    ]
    lines = render_table(status(allocations, isolation=KILLING), now=1065.0).splitlines()
    assert "ISOLATION MEM/CORE" in next(line for line in lines if line.startswith("POD"))
    assert "enforced/advisory" in next(line for line in lines if line.startswith("ns/p1"))
    assert "exclusive/exclusive" in next(line for line in lines if "whole card" in line)
    reasons = lines[lines.index("isolation (docs/isolation.md):") + 1 :]
    assert len(reasons) == 2  # a1 and a2 share their reasons; whole cards need none
    assert reasons[0].startswith("  compute advisory: MPS applies the share from the client")
    assert reasons[1].startswith("  memory enforced: the watchdog adds up")
    unknown = render_table(status(allocations[:1]), now=1065.0)
    assert "?" in next(line for line in unknown.splitlines() if line.startswith("ns/p1"))
    assert "isolation (docs/" not in unknown


def test_claims_and_device_plugin_allocations_share_one_table_with_isolation():
    """A DRA claim's allocation is a row of the same table: named by its claim (JSON
    ``claim``), with its quota and isolation levels next to the device plugin's rows."""
    from dataclasses import replace

    from nodemgr.domain.model import ClaimRef

    claim = replace(shared("c1", GPU0, 2, 10), claim=ClaimRef("u-1", "ml", "train-gpu", ()))
    doc = status([shared("a1", GPU0, 4, 30, ContainerRef("ns", "p1", "main")), claim],
                 isolation=KILLING)  # fmt: skip
    rows = {a["id"]: a for a in doc["allocations"]}
    assert rows["c1"]["claim"] == {"namespace": "ml", "name": "train-gpu", "uid": "u-1"}
    assert rows["a1"]["claim"] is None
    lines = render_table(doc, now=1065.0).splitlines()
    claim_row = next(line for line in lines if line.startswith("claim ml/train-gpu"))
    assert "2.0G /" in claim_row and "10%" in claim_row and "enforced/advisory" in claim_row
    assert any(line.startswith("ns/p1") and "enforced/advisory" in line for line in lines)
