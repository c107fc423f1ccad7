"""What the hostile-tenant modules share: one node per module (the real daemon with
NVIDIA's real MPS control binary, the test kubelet and real runc containers), emptied
before each test."""

from __future__ import annotations

import pytest

from standins import real_parts
from standins.mps_tenant import MpsNode
from tests.hostile import tenant


@pytest.fixture(scope="module")
def node_options() -> dict:
    """What a module's node is made with beyond the defaults (``MpsNode`` keywords)."""
    return {}


@pytest.fixture(scope="module")
def shared(node_options):
    cluster = MpsNode(real_parts.require().mps_control, **node_options)
    try:
        yield tenant.Site(cluster)
    finally:
        cluster.close()  # containers first: impostors in them would look like daemons


@pytest.fixture
def site(shared):
    """The shared node, emptied: no container, GPU process, pod or allocation."""
    shared.reset()
    return shared
