"""Pins placement: one card fits memory AND share together; binpack is best fit by
absolute free memory, spread picks the emptiest by fraction; refusals name every card."""

import pytest

from nodemgr.domain.placement import (
    CardLoad,
    NoFitDescriber,
    SharedRequest,
    choose_card,
    format_mib,
)
from nodemgr.errors import NoFitError

DESCRIBE = NoFitDescriber("node-a", 1024)


def card(index, total, free, core_free=100, name="Tesla T4", reason=""):
    return CardLoad(index, f"GPU-{index}", name, total, free, core_free, reason)


def test_binpack_picks_the_fitting_card_left_with_least_free_memory():
    cards = [card(0, 15, 15), card(1, 15, 6), card(2, 15, 3)]
    assert choose_card(cards, SharedRequest(4), "binpack", DESCRIBE).index == 1


def test_spread_picks_the_emptiest_card():
    cards = [card(0, 15, 10), card(1, 15, 15), card(2, 15, 3)]
    assert choose_card(cards, SharedRequest(4), "spread", DESCRIBE).index == 1


def test_mixed_sizes_binpack_fills_the_small_card_first():
    cards = [card(0, 80, 80, name="A100 80GB"), card(1, 15, 15)]
    assert choose_card(cards, SharedRequest(8), "binpack", DESCRIBE).index == 1


def test_mixed_sizes_spread_compares_fractions_not_absolute_memory():
    # GPU0 has more GiB free (40) but is half full; GPU1 is empty.
    cards = [card(0, 80, 40, name="A100 80GB"), card(1, 15, 15)]
    assert choose_card(cards, SharedRequest(4), "spread", DESCRIBE).index == 1


def test_memory_and_share_must_fit_on_the_same_card():
    # GPU0 has memory but no share; GPU1 has share but no memory; GPU2 has both.
    cards = [card(0, 15, 15, core_free=10), card(1, 15, 2, core_free=100), card(2, 15, 8, 50)]
    assert choose_card(cards, SharedRequest(4, 30), "binpack", DESCRIBE).index == 2


def test_fragmentation_refuses_although_the_node_total_would_fit():
    cards = [card(0, 15, 8), card(1, 15, 8)]  # 16 free in total, 8 per card
    with pytest.raises(NoFitError) as refused:
        choose_card(cards, SharedRequest(10), "binpack", DESCRIBE)
    assert str(refused.value) == (
        "no single GPU on node-a has 10 GiB free: "
        "GPU0 (Tesla T4) has 8 GiB/100% free, GPU1 (Tesla T4) has 8 GiB/100% free"
    )


def test_refusal_names_both_amounts_and_unavailable_cards():
    cards = [card(0, 15, 12, core_free=70), card(1, 15, 15, reason="given out whole")]
    with pytest.raises(
        NoFitError,
        match=r"has 16 GiB and 30% free: GPU0 \(Tesla T4\) has "
        r"12 GiB/70% free, GPU1 \(Tesla T4\) has none \(given out whole\)",
    ):
        choose_card(cards, SharedRequest(16, 30), "binpack", DESCRIBE)


def test_ties_go_to_the_lowest_index():
    cards = [card(0, 15, 15), card(1, 15, 15)]
    assert choose_card(cards, SharedRequest(1), "binpack", DESCRIBE).index == 0
    assert choose_card(cards, SharedRequest(1), "spread", DESCRIBE).index == 0


def test_share_only_request_binpacks_on_share():
    cards = [card(0, 15, 15, core_free=90), card(1, 15, 15, core_free=40)]
    assert choose_card(cards, SharedRequest(0, 30), "binpack", DESCRIBE).index == 1


def test_unknown_policy_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown placement policy 'random'"):
        choose_card([card(0, 15, 15)], SharedRequest(1), "random", DESCRIBE)


def test_format_mib():
    assert format_mib(4096) == "4 GiB"
    assert format_mib(1536) == "1536 MiB"
