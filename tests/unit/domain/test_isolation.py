"""nodemgr.domain.isolation: what the node really enforces for one allocation.

Pins the level for memory and for compute from the allocation (whole, memory
quota, share) and the node's facts (watchdog running, its action, per-process
memory readable; the card's MPS state and ceiling; a kernel dmem region), the
reason given with each level, and the JSON keys.
"""

from __future__ import annotations

import pytest

from nodemgr.domain.isolation import (
    ADVISORY,
    COMPUTE_LEVELS,
    ENFORCED,
    EXCLUSIVE,
    MEMORY_LEVELS,
    UNLIMITED,
    WATCHED,
    CardIsolationFacts,
    Isolation,
    WatchdogFacts,
    isolation_of,
)

KILLING = WatchdogFacts(running=True, action="kill", usage_readable=True)
MPS_READY = CardIsolationFacts("healthy", ceiling_set=True)


def shared(memory_mib=4096, core_percent=30, card=MPS_READY, watchdog=KILLING) -> Isolation:
    return isolation_of(
        whole=False, memory_mib=memory_mib, core_percent=core_percent, card=card, watchdog=watchdog
    )


def test_whole_card_is_exclusive_whatever_the_node_has():
    """A whole card is the container's alone: exclusive memory and compute, even with the
    watchdog down and MPS off (nothing shares it to be protected from)."""
    down = WatchdogFacts(running=False, action=None, usage_readable=False)
    got = isolation_of(
        whole=True, memory_mib=15360, core_percent=100, card=CardIsolationFacts("off", False),
        watchdog=down,
    )  # fmt: skip
    assert (got.memory, got.compute) == (EXCLUSIVE, EXCLUSIVE)
    assert "whole card" in got.memory_detail and "whole card" in got.compute_detail


def test_shared_with_a_killing_watchdog_and_mps_is_enforced_memory_advisory_compute():
    """The usual shared container: the watchdog's sum bounds memory (it does not depend on
    the env), while the share is only the client's env, which a process can rewrite in
    its live environ after exec (not 'judged at exec')."""
    got = shared()
    assert (got.memory, got.compute) == (ENFORCED, ADVISORY)
    assert "kills the newest above quota + enforcement.grace_mib" in got.memory_detail
    assert "MPS caps each process at the pinned limit of its env" in got.memory_detail
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in got.compute_detail
    assert "rewrite its live environ after exec" in got.compute_detail
    assert "no per-client ceiling" in got.compute_detail


def test_action_log_only_watches_memory():
    """enforcement.action: log reports and kills nothing: watched, saying so."""
    got = shared(watchdog=WatchdogFacts(running=True, action="log", usage_readable=True))
    assert got.memory == WATCHED
    assert "killing nothing (enforcement.action: log)" in got.memory_detail


@pytest.mark.parametrize(
    ("watchdog", "why"),
    [
        (WatchdogFacts(running=False, action="kill", usage_readable=True), "the watchdog is down"),
        (
            WatchdogFacts(running=True, action="kill", usage_readable=False),
            "per-process GPU memory cannot be read",
        ),
        (
            WatchdogFacts(running=True, action="explode", usage_readable=True),
            "'explode' is not known to kill",
        ),
        (WatchdogFacts(running=True, action=None, usage_readable=True), "None is not known"),
    ],
)
def test_memory_is_advisory_when_the_watchdog_cannot_judge(watchdog, why):
    """A watchdog that is down, cannot read per-process memory, or has an action this code
    does not know leaves only the env: advisory, with the reason (fail closed)."""
    got = shared(watchdog=watchdog)
    assert got.memory == ADVISORY
    assert why in got.memory_detail
    assert "check" in got.memory_detail and "the quota" in got.memory_detail


@pytest.mark.parametrize(
    ("card", "memory_says", "compute_says"),
    [
        (
            CardIsolationFacts("down", ceiling_set=False),
            "MPS is down: no per-process limit between scans",
            "share not applied while MPS is down",
        ),
        (
            CardIsolationFacts("disabled", ceiling_set=False),
            "no MPS (mps.enabled false)",
            "no MPS (mps.enabled false)",
        ),
        (
            CardIsolationFacts("unknown", ceiling_set=False),
            "MPS is unknown",
            "while MPS is unknown",
        ),
    ],
)
def test_without_healthy_mps_the_share_is_not_applied(card, memory_says, compute_says):
    """With MPS not running healthy nothing applies the thread percentage (compute
    unlimited); memory stays enforced by the watchdog's sum, the reason saying there is
    no per-process limit between scans."""
    got = shared(card=card)
    assert (got.memory, got.compute) == (ENFORCED, UNLIMITED)
    assert memory_says in got.memory_detail
    assert compute_says in got.compute_detail


def test_healthy_mps_with_a_card_problem_does_not_claim_the_ceiling():
    """MPS answering but the card in trouble (the ceiling could not be set): the reason
    does not claim the server-side ceiling."""
    got = shared(card=CardIsolationFacts("healthy", ceiling_set=False))
    assert "server-side ceiling may not be set" in got.memory_detail
    assert "caps each process" not in got.memory_detail
    assert got.compute == ADVISORY


def test_no_quota_asked_is_unlimited():
    """Share only: no memory quota (the watchdog sums nothing for it); memory only: no
    thread limit. Both say so."""
    share_only = shared(memory_mib=0)
    assert share_only.memory == UNLIMITED
    assert "no memory quota asked" in share_only.memory_detail
    memory_only = shared(core_percent=0)
    assert memory_only.compute == UNLIMITED
    assert "no compute share asked" in memory_only.compute_detail


def test_a_dmem_region_is_named_but_not_claimed_as_a_hard_limit():
    """A kernel dmem region for the card is reported, and said to be unused: gpushare-node
    writes no dmem.max, so the level stays what the watchdog gives."""
    card = CardIsolationFacts("healthy", ceiling_set=True, dmem_region="drm/0000:03:00.0/vram0")
    got = shared(card=card)
    assert got.memory == ENFORCED
    assert "dmem region drm/0000:03:00.0/vram0 exists but gpushare-node sets no dmem.max" in (
        got.memory_detail
    )
    assert "dmem" not in shared().memory_detail


def test_json_keys_and_levels_are_stable_strings():
    """The JSON contract: four string keys; levels from the documented sets only."""
    got = shared().as_json()
    assert set(got) == {"memory", "memory_detail", "compute", "compute_detail"}
    assert all(isinstance(v, str) and v for v in got.values())
    assert MEMORY_LEVELS == ("exclusive", "enforced", "watched", "advisory", "unlimited")
    assert COMPUTE_LEVELS == ("exclusive", "advisory", "unlimited")
