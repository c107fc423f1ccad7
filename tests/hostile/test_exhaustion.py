"""Exhaustion of the daemon's listeners: every socket it serves, flooded, while its open-file
limit is the 1024 that systemd gives a unit without LimitNOFILE=.

The node is the real gpushare-node (RLIMIT_NOFILE 1024, soft and hard, set with prlimit)
with NVIDIA's real MPS control binary, the test kubelet and real runc containers made from
real Allocate responses. Each test floods one listener (the metrics port, the status and
hook sockets, each device plugin socket) with connections that send nothing, a byte now and
then, a request far over its budget and bytes that are no request, and checks meanwhile
that enforcement goes on (a runc container's process over its quota is killed) and that
admission goes on (an Allocate through the test kubelet, a GPU container through the runtime
hook). Each records one row of the README table "Exhaustion" from what it observed; the
last test compares the table with the README (``scripts/update-tables`` rewrites it).
"""

from __future__ import annotations

import time

import pytest

from tests.harness import real_parts
from tests.harness.daemon_proc import GPU0
from tests.harness.mps_tenant import MpsNode
from tests.harness.outcome_table import OutcomeTable
from tests.hostile import floods, tenant
from tests.hostile.tenant import killed_within

pytestmark = [pytest.mark.e2e, pytest.mark.outcome_table]

# How long a flood runs before the checks (unless the daemon's open files reach its limit
# first): the kernel delivers what it queued, the flood reopens what the daemon closed.
FLOOD_SETTLE_SECONDS = 10.0
# What systemd gives a unit without LimitNOFILE= (its soft limit); here soft and hard.
NOFILE = 1024
IDLE_METRICS = (
    f"1,200 TCP connections to the metrics port (loopback: any local user) that send one "
    f"byte and then nothing, reopened as the daemon closes them; its RLIMIT_NOFILE {NOFILE}"
)

TABLE = OutcomeTable(
    "hostile-exhaustion",
    "tests/hostile/test_exhaustion.py",
    ("attack", "result", "what the attacker got"),
    (IDLE_METRICS,),
)


@pytest.fixture(scope="module")
def shared():
    cluster = MpsNode(real_parts.require().mps_control, nofile=NOFILE)
    try:
        yield tenant.Site(cluster)
    finally:
        cluster.close()


@pytest.fixture
def site(shared):
    """The shared node, emptied: no container, GPU process, pod or allocation."""
    shared.reset()
    return shared


def settle(fds: floods.FdWatch) -> None:
    """Let a flood run FLOOD_SETTLE_SECONDS, or until the daemon is at its open-file limit."""
    deadline = time.monotonic() + FLOOD_SETTLE_SECONDS
    while time.monotonic() < deadline and fds.peak < NOFILE - 8:
        time.sleep(0.1)


def metrics_address(site: tenant.Site) -> tuple[str, int]:
    host, _, port = site.status()["daemon"]["metrics_address"].rpartition(":")
    return host.strip("[]"), int(port)


@pytest.mark.timeout(900)
def test_idle_connections_to_the_metrics_port_stop_nothing(site):
    """1,200 connections to the metrics port that send nothing, each reopened when closed,
    against a daemon with RLIMIT_NOFILE 1024: a runc container's process at 9,000 MiB of
    its 4,096 MiB quota is killed, a new pod is admitted through kubelet and its GPU
    container through the hook, a crashed MPS control daemon is started again and the card
    is Healthy, and the daemon stays healthy; its open files stay under its limit."""
    cluster = site.cluster
    cluster.wait_mps_ready()
    pid = cluster.node.process.pid
    assert floods.nofile_limit(pid) == NOFILE
    site.start("victim")
    init = cluster.runtime.pid("victim")
    site.police("victim", (init, GPU0, 100))
    host, port = metrics_address(site)
    with (
        floods.FdWatch(pid) as fds,
        floods.Flood(floods.tcp(host, port, b"G"), 1200, reopen=True),
    ):
        settle(fds)
        cluster.set_usage([(init, GPU0, 9000)])
        killed = killed_within(init, "a process at 9,000 MiB of a 4,096 MiB quota")
        site.start("during")  # Allocate through kubelet, the container through the hook
        new_mps = cluster.restart_daemon()
        assert site.healthy()
        peak = fds.peak
    assert cluster.card_health() == {"Healthy"} and new_mps in cluster.ready_pids()
    assert peak < NOFILE, peak
    TABLE.record(
        IDLE_METRICS,
        f"a process at 9,000 MiB of its 4,096 MiB quota {killed}; a pod admitted and its GPU "
        "container started; MPS restarted after a crash, card Healthy; daemon healthy",
        "nothing",
    )


def test_readme_table_says_what_was_observed():
    """After a complete run, the README table is what this module observed."""
    if not TABLE.complete:
        missing = [c for c in TABLE.expected_cases if c not in TABLE.rows]
        pytest.skip(f"partial run, the README table is not judged (no row for {missing})")
    problem = TABLE.check_or_update()
    assert problem is None, problem
