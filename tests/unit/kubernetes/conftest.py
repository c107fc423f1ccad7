"""The test API server the Kubernetes adapter's tests run against (one per test)."""

import pytest

from standins.apiserver_sim import TestApiServer
from tests.unit.kubernetes.support import NODE, PREFIX


@pytest.fixture
def api():
    server = TestApiServer()
    server.start()
    server.add_node(NODE, labels={"team": "vision", PREFIX + "stale": "1"})
    yield server
    server.stop()
