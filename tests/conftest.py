"""Shared fixtures: simulated cards and settings for unit tests; and after every test that
wrote a ledger, that ledger's invariants (nodemgr check-ledger) must hold."""

from __future__ import annotations

import pytest

from nodemgr.allocation import ledger as ledger_module
from nodemgr.allocation.audit import audit_ledger
from nodemgr.errors import LedgerError
from standins.cards import simulated_settings


@pytest.fixture
def settings(tmp_path):
    return simulated_settings(str(tmp_path))


@pytest.fixture(autouse=True)
def ledgers_stay_sound(monkeypatch, request):
    """Every ledger this test opened for writing is audited at its end: no device held
    twice, limits consistent, no container registered to a freed allocation. A test that
    breaks a ledger on purpose is marked ``broken_ledger``."""
    opened: list[str] = []
    real_init = ledger_module.Ledger.__init__

    def recording_init(self, state_dir, *, read_only=False):
        real_init(self, state_dir, read_only=read_only)
        if not read_only:
            opened.append(state_dir)

    monkeypatch.setattr(ledger_module.Ledger, "__init__", recording_init)
    yield
    if request.node.get_closest_marker("broken_ledger"):
        return
    for state_dir in dict.fromkeys(opened):
        try:
            audit = audit_ledger(state_dir, 1024, None)
        except LedgerError:
            continue  # gone, or broken on purpose by the test: its own assertions judge it
        assert audit.problems == [], f"ledger {audit.path} breaks its invariants"
