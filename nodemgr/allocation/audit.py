"""Auditing a ledger on disk against its invariants (``nodemgr check-ledger``, doctor).

Opens the ledger read-only, so a running daemon is not disturbed; without card
capacities the capacity checks are skipped and the report says so.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from nodemgr.allocation.ledger import LEDGER_FILE, Ledger
from nodemgr.config.schema import Settings
from nodemgr.domain.invariants import CardCapacity, check_invariants
from nodemgr.errors import GpushareError
from nodemgr.inventory import open_inventory


@dataclass(frozen=True)
class LedgerAudit:
    path: str
    allocations: int
    containers: int
    capacities_checked: bool
    problems: list[str] = field(default_factory=list)


def audit_ledger(
    state_dir: str, memory_unit_mib: int, cards: Sequence[CardCapacity] | None
) -> LedgerAudit:
    ledger = Ledger(state_dir, read_only=True)
    try:
        allocations = ledger.load()
        registrations = ledger.load_registrations()
    finally:
        ledger.close()
    problems = check_invariants(allocations, cards, memory_unit_mib, registrations)
    return LedgerAudit(
        os.path.join(state_dir, LEDGER_FILE),
        len(allocations),
        len(registrations),
        cards is not None,
        problems,
    )


def card_capacities(settings: Settings) -> tuple[list[CardCapacity] | None, str | None]:
    """This node's cards, or (None, why) when they cannot be read."""
    unit = settings.resources.memory_unit_mib
    try:
        inventory = open_inventory(settings.gpus)
        try:
            cards = inventory.cards()
        finally:
            inventory.close()
    except GpushareError as e:
        return None, str(e)
    return [CardCapacity(c.uuid, c.index, c.memory_mib // unit) for c in cards], None
