"""Choosing the one card that fits a container's shared request (pure, no I/O).

A container's GPU memory and compute share always land on ONE card. Policies:

- ``binpack`` (best fit, like the gpushare scheduler extender): the fitting card
  left with the least free memory (absolute MiB, so a small card fills before
  a big one), then the least free share;
- ``spread``: the emptiest fitting card, by free fraction of memory, then of
  share (fractions, so mixed card sizes are compared fairly).

Ties go to the lowest card index, so placement is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nodemgr.errors import NoFitError

POLICIES = ("binpack", "spread")


@dataclass(frozen=True)
class CardLoad:
    """What one card can still take, in kubelet's units."""

    index: int
    uuid: str
    name: str
    memory_units_total: int
    memory_units_free: int
    core_percent_free: int
    # Why the card takes no shared work ("" when it can).
    unavailable_reason: str = ""


@dataclass(frozen=True)
class SharedRequest:
    memory_units: int = 0
    core_percent: int = 0

    def fits(self, card: CardLoad) -> bool:
        return (
            not card.unavailable_reason
            and card.memory_units_free >= self.memory_units
            and card.core_percent_free >= self.core_percent
        )


def choose_card(
    cards: Sequence[CardLoad], request: SharedRequest, policy: str, describe: NoFitDescriber
) -> CardLoad:
    """The card the policy picks for the request; NoFitError naming every card if none fits."""
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}")
    fitting = [card for card in cards if request.fits(card)]
    if not fitting:
        raise NoFitError(describe(request, cards))
    if policy == "binpack":
        return min(
            fitting,
            key=lambda c: (
                c.memory_units_free - request.memory_units,
                c.core_percent_free - request.core_percent,
                c.index,
            ),
        )
    return min(
        fitting,
        key=lambda c: (
            -(c.memory_units_free / c.memory_units_total if c.memory_units_total else 0.0),
            -c.core_percent_free,
            c.index,
        ),
    )


@dataclass(frozen=True)
class NoFitDescriber:
    """``no single GPU on node-a has 16 GiB and 30% free: GPU0 (Tesla T4) has
    12 GiB/70%, GPU1 (Tesla T4) has 15 GiB/100%``"""

    node_name: str
    memory_unit_mib: int

    def memory(self, units: int) -> str:
        return format_mib(units * self.memory_unit_mib)

    def wanted(self, request: SharedRequest) -> str:
        parts = []
        if request.memory_units:
            parts.append(self.memory(request.memory_units))
        if request.core_percent:
            parts.append(f"{request.core_percent}%")
        return " and ".join(parts) or "nothing"

    def card(self, card: CardLoad) -> str:
        free = f"{self.memory(card.memory_units_free)}/{card.core_percent_free}%"
        state = (
            f"{free} free" if not card.unavailable_reason else f"none ({card.unavailable_reason})"
        )
        return f"GPU{card.index} ({card.name}) has {state}"

    def __call__(self, request: SharedRequest, cards: Sequence[CardLoad]) -> str:
        listing = ", ".join(self.card(c) for c in cards) or "no GPUs"
        return f"no single GPU on {self.node_name} has {self.wanted(request)} free: {listing}"


def format_mib(mib: int) -> str:
    """Whole GiB when exact, MiB otherwise."""
    if mib % 1024 == 0:
        return f"{mib // 1024} GiB"
    return f"{mib} MiB"
