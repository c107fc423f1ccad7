"""Shared fixtures: simulated cards and settings for unit tests."""

from __future__ import annotations

import pytest

from tests.harness.cards import simulated_settings


@pytest.fixture
def settings(tmp_path):
    return simulated_settings(str(tmp_path))
