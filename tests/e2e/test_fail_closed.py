"""End to end: the real gpushare-node whose watchdog cannot judge the GPU processes fails
closed, under a stand-in systemd (a real notify socket), with real runc and the shipped
runtime hook.

Pins: while the per-process GPU memory cannot be read (here the simulated usage file holds
no JSON; on a GPU node NVML failing, or the daemon out of descriptors), the daemon sends no
WATCHDOG=1 (systemd would restart it), STATUS= says NOT HEALTHY and why, `nodemgr status
--json` has ``daemon.healthy`` false with the reason in ``daemon.problems`` and
``enforcement.judging`` false, the metrics say ``gpushare_enforcement_judging 0`` and
``gpushare_daemon_healthy 0``, and the runtime hook refuses a GPU container naming why; once
the file reads again, all of it clears without a restart and the container starts.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from standins.notify_listener import Listener
from standins.runc_env import EnforcementNode

pytestmark = pytest.mark.e2e

WHY = "watchdog: enforcement cannot judge: cannot read per-process GPU memory: simulated usage"


@pytest.fixture
def cluster():
    systemd = Listener()
    env = {"NOTIFY_SOCKET": systemd.address, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": ""}
    cluster = EnforcementNode(env=env)
    cluster.systemd = systemd
    yield cluster
    cluster.close()
    systemd.close()


def collect(cluster, seconds: float) -> list[dict[str, str]]:
    messages, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        messages += cluster.systemd.messages(wait=0.1)
    return messages


def status(cluster) -> dict:
    done = cluster.node.nodemgr("status", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def scrape(cluster, address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith(("gpushare_enforcement_judging", "gpushare_daemon_healthy"))
    }


def test_a_watchdog_that_cannot_judge_makes_the_daemon_unhealthy_until_it_can(cluster):
    node = cluster.node
    node.wait_for(lambda: any(m.get("READY") == "1" for m in collect(cluster, 0.5)), 30, "READY")
    env, mounts = cluster.admit("late")
    with open(cluster.usage_file, "w") as f:
        f.write("{not json")
    seen = collect(cluster, 3.0)
    down = [m["STATUS"] for m in seen if m.get("STATUS", "").startswith("NOT HEALTHY: ")]
    assert down and down[-1].startswith(f"NOT HEALTHY: {WHY}"), seen
    after = seen[[m.get("STATUS") for m in seen].index(down[0]) + 1 :]
    assert not [m for m in after if "WATCHDOG" in m], after  # pings every 0.5 s otherwise
    doc = status(cluster)
    assert doc["daemon"]["healthy"] is False
    [problem] = doc["daemon"]["problems"]
    assert problem.startswith(WHY), problem
    assert doc["enforcement"]["judging"] is False and doc["enforcement"]["failed_scans"] > 0
    assert scrape(cluster, doc["daemon"]["metrics_address"]) == {
        "gpushare_daemon_healthy": 0.0,
        "gpushare_enforcement_judging": 0.0,
    }
    refused = cluster.start_in_pod("late", "late", env, mounts)
    assert refused.returncode != 0
    assert "enforcement cannot judge" in refused.stdout and "unpoliced" in refused.stdout
    assert "late" not in cluster.registered()

    cluster.set_usage([])
    node.wait_for(lambda: {"WATCHDOG": "1"} in collect(cluster, 1.0), 10, "WATCHDOG=1 again")
    doc = status(cluster)
    assert (doc["daemon"]["healthy"], doc["daemon"]["problems"]) == (True, [])
    assert doc["enforcement"]["judging"] is True
    started = cluster.start_in_pod("late-again", "late", env, mounts)
    assert started.returncode == 0, started.stdout
    assert "judges the GPU processes again" in node.log()
