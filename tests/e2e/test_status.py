"""End to end: the real gpushare-node under a stand-in systemd, and `nodemgr status`.

Pins: READY=1 only once every resource is registered with kubelet (not
before kubelet exists); STATUS= says what it waits for and then a summary;
WATCHDOG=1 pings while waiting and while serving; SIGHUP gives RELOADING=1
(with MONOTONIC_USEC) then READY=1, applies reloadable keys and names the ones
that need a restart; a bad config on reload keeps the daemon running; SIGTERM
gives STOPPING=1. `nodemgr status` shows what kubelet admitted (table and
--json contract keys), and with the daemon down the ledger's last state
(exit 3). The notify socket is a real AF_UNIX datagram socket.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import yaml

from standins.daemon_proc import CORE, GPU0, GPU1, MEMORY, WHOLE, Node
from standins.kubelet_sim import ContainerSpec, TestKubelet
from standins.notify_listener import Listener

pytestmark = pytest.mark.e2e


@pytest.fixture
def node():
    node = Node()
    node.kubelet = TestKubelet(node.device_plugin_dir, node.pod_resources_socket)
    node.systemd = Listener()
    yield node
    node.cleanup()
    node.kubelet.stop()
    node.systemd.close()


def start_under_systemd(node: Node, watchdog_usec: int = 1_000_000) -> None:
    node.start(
        env={
            "NOTIFY_SOCKET": node.systemd.address,
            "WATCHDOG_USEC": str(watchdog_usec),
            "WATCHDOG_PID": "",  # systemd sets it to the service's PID; unset is valid too
        }
    )


def collect(node: Node, seconds: float) -> list[dict[str, str]]:
    messages, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        messages += node.systemd.messages(wait=0.1)
    return messages


def wait_for_message(node: Node, predicate, timeout: float = 15.0) -> list[dict[str, str]]:
    """Messages up to and including the first one matching ``predicate``."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        for message in node.systemd.messages(wait=0.1):
            seen.append(message)
            if predicate(message):
                return seen
    raise AssertionError(f"no such message in {seen}; daemon log:\n{node.log()}")


def test_ready_only_after_registration_then_watchdog_and_status(node):
    start_under_systemd(node)
    waiting = wait_for_message(node, lambda m: m.get("STATUS", "").startswith("waiting for kub"))
    assert waiting[0]["STATUS"].startswith("starting")
    waiting += collect(node, 3.0)  # no kubelet yet
    assert not any("READY" in m for m in waiting), waiting
    assert sum(m == {"WATCHDOG": "1"} for m in waiting) >= 4  # waiting is healthy
    node.kubelet.start()
    seen = wait_for_message(node, lambda m: m.get("READY") == "1")
    for resource in (MEMORY, CORE, WHOLE):  # READY came after every registration
        assert node.kubelet.devices(resource)
    assert seen[-1]["STATUS"] == "serving 3 resources on 2 GPUs, 0 allocations"
    serving = collect(node, 2.0)
    assert sum(m == {"WATCHDOG": "1"} for m in serving) >= 3
    node.signal(signal.SIGTERM)
    assert node.wait(10) == 0
    assert {"STOPPING": "1", "STATUS": "stopping"} in node.systemd.messages()


def test_reload_applies_what_it_can_and_names_what_needs_a_restart(node):
    node.kubelet.start()
    start_under_systemd(node)
    wait_for_message(node, lambda m: m.get("READY") == "1")

    def change(config):
        config["enforcement"] = {"action": "log", "grace_mib": 512}
        config["resources"] = {"placement": "spread"}

    node.rewrite_config(change)
    node.signal(signal.SIGHUP)
    seen = wait_for_message(node, lambda m: m.get("READY") == "1")
    reloading = next(m for m in seen if m.get("RELOADING") == "1")
    assert int(reloading["MONOTONIC_USEC"]) > 0
    assert seen.index(reloading) < len(seen) - 1  # READY after RELOADING
    status = seen[-1]["STATUS"]
    assert "applied enforcement.action, enforcement.grace_mib" in status
    assert "needs a restart to take effect: resources.placement" in status
    doc = json.loads(node.nodemgr("status", "--json").stdout)
    assert doc["enforcement"]["action"] == "log"  # applied to the running watchdog

    node.rewrite_config(lambda config: config.update(enforcement={"action": "explode"}))
    node.signal(signal.SIGHUP)
    seen = wait_for_message(node, lambda m: m.get("READY") == "1")
    assert "reload refused" in seen[-1]["STATUS"] and "enforcement.action" in seen[-1]["STATUS"]
    assert "reload refused, the running configuration stays" in node.log()
    # Still serving with the configuration it had: its status socket answers after the
    # refusal (nodemgr itself needs a valid file to find the socket: put one back first).
    node.rewrite_config(lambda config: config.update(enforcement={"action": "log"}))
    after = json.loads(node.nodemgr("status", "--json").stdout)
    assert after["source"] == "daemon" and after["enforcement"]["action"] == "log"
    assert node.process.poll() is None


def test_status_shows_what_kubelet_admitted_and_the_ledger_when_down(node):
    node.kubelet.start()
    node.start()
    for resource in (MEMORY, CORE, WHOLE):
        node.kubelet.wait_for_resource(resource, timeout=20)
    two = [ContainerSpec("main", {MEMORY: 4, CORE: 30}), ContainerSpec("side", {MEMORY: 2})]
    assert node.kubelet.admit_pod("team-a", "infer", two).ok
    assert node.kubelet.admit_pod("team-b", "train", [ContainerSpec("main", {WHOLE: 1})]).ok
    node.wait_for(
        lambda: all(a["pod"] for a in node.allocations()) and len(node.allocations()) == 3,
        what="kubelet's record to name every allocation's pod",
    )
    done = node.nodemgr("status", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["source"] == "daemon" and doc["daemon"]["ready"] is True
    gpus = {g["uuid"]: g for g in doc["gpus"]}
    for gpu in gpus.values():
        assert {"uuid", "mode", "memory_total_mib", "memory_allocated_mib",
                "core_allocated_percent"} <= gpu.keys()  # fmt: skip
    shared_card = next(u for u, g in gpus.items() if g["mode"] == "shared")
    whole_card = ({GPU0, GPU1} - {shared_card}).pop()
    assert gpus[shared_card]["memory_allocated_mib"] == 6144
    assert gpus[shared_card]["core_allocated_percent"] == 30
    assert gpus[shared_card]["mps"]["state"] == "healthy"
    assert gpus[whole_card]["mode"] == "whole"
    rows = {(a["namespace"], a["pod"], a["container"]): a for a in doc["allocations"]}
    main = rows[("team-a", "infer", "main")]
    assert (main["gpu"], main["memory_mib"], main["core_percent"], main["whole"]) == (
        shared_card,
        4096,
        30,
        False,
    )
    assert rows[("team-a", "infer", "side")]["memory_mib"] == 2048
    train = rows[("team-b", "train", "main")]
    assert (train["gpu"], train["whole"]) == (whole_card, True)

    table = node.nodemgr("status").stdout
    assert "ready" in table.splitlines()[0]
    assert any(line.startswith("team-a/infer") and "main" in line and "30%" in line
               for line in table.splitlines())  # fmt: skip
    assert any(line.startswith("team-b/train") and "whole card" in line
               for line in table.splitlines())  # fmt: skip

    node.stop()
    down = node.nodemgr("status", "--json")
    assert down.returncode == 3
    assert "not answering" in down.stderr
    last = json.loads(down.stdout)
    assert last["source"] == "ledger" and last["daemon"] is None
    assert {(a["namespace"], a["pod"], a["container"]) for a in last["allocations"]} == set(rows)
    assert [g["uuid"] for g in last["gpus"]] == [GPU0, GPU1]


def test_status_socket_is_root_only(node):
    node.kubelet.start()
    node.start()
    socket_path = os.path.join(node.root, "run", "status.sock")
    node.wait_for(lambda: os.path.exists(socket_path), what="the status socket")
    assert os.stat(socket_path).st_mode & 0o777 == 0o600
    with open(node.config_path) as f:
        assert yaml.safe_load(f)["run_dir"] == os.path.join(node.root, "run")


def test_metrics_endpoint_serves_what_the_node_holds(node):
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    node.kubelet.start()
    node.start()
    for resource in (MEMORY, CORE, WHOLE):
        node.kubelet.wait_for_resource(resource, timeout=20)
    pod = [ContainerSpec("main", {MEMORY: 4, CORE: 30})]
    assert node.kubelet.admit_pod("default", "job", pod).ok
    node.wait_for(lambda: any(a["pod"] for a in node.allocations()), what="the pod's identity")
    address = json.loads(node.nodemgr("status", "--json").stdout)["daemon"]["metrics_address"]
    assert address.startswith("127.0.0.1:") and not address.endswith(":0")

    def scrape() -> dict[tuple, float]:
        with urlopen(f"http://{address}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def value(samples, name, **labels):
        found = [
            v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()
        ]
        assert len(found) == 1, (name, labels, found)
        return found[0]

    samples = node.wait_for(
        lambda: (s := scrape()) and value(s, "gpushare_reconcile_total", result="ok") >= 1 and s,
        what="a reconcile counted",
    )
    card = json.loads(node.nodemgr("status", "--json").stdout)["allocations"][0]["gpu"]
    assert value(samples, "gpushare_gpu_memory_allocated_bytes", gpu=card) == 4 * 2**30
    assert value(samples, "gpushare_gpu_memory_total_bytes", gpu=card) == 15 * 2**30
    assert value(samples, "gpushare_gpu_core_allocated_ratio", gpu=card) == pytest.approx(0.30)
    assert value(samples, "gpushare_gpu_mps_up", gpu=card) == 1
    quota = value(samples, "gpushare_allocation_memory_quota_bytes", pod="job", container="main")
    assert quota == 4 * 2**30
    allocations = value(
        samples, "gpushare_allocate_duration_seconds_count", resource=MEMORY, result="ok"
    )
    assert allocations == 1
    assert value(samples, "gpushare_enforcement_kills_total") == 0
    assert value(samples, "gpushare_daemon_ready") == 1


def admit_shared_and_whole(node: Node) -> dict:
    """Pod team-a/infer with two shared containers (4 GiB + 30 %, 2 GiB) and team-b/train
    with a whole card, all named by kubelet's record; the status document then."""
    node.kubelet.start()
    node.start()
    for resource in (MEMORY, CORE, WHOLE):
        node.kubelet.wait_for_resource(resource, timeout=20)
    shared = [ContainerSpec("main", {MEMORY: 4, CORE: 30}), ContainerSpec("side", {MEMORY: 2})]
    assert node.kubelet.admit_pod("team-a", "infer", shared).ok
    assert node.kubelet.admit_pod("team-b", "train", [ContainerSpec("main", {WHOLE: 1})]).ok
    node.wait_for(
        lambda: all(a["pod"] for a in node.allocations()) and len(node.allocations()) == 3,
        what="kubelet's record to name every allocation's pod",
    )
    return json.loads(node.nodemgr("status", "--json").stdout)


def test_metrics_name_owners_never_allocation_ids(node):
    """Issue 14 item 5: the metrics endpoint, readable by every local user and
    hostNetwork pod, names an allocation by its owner (namespace/pod/container), never
    by its id (the GPUSHARE_ALLOCATION_ID that the runtime hook takes as credential):
    no allocation id appears anywhere in the scraped text."""
    from urllib.request import urlopen

    doc = admit_shared_and_whole(node)
    address = doc["daemon"]["metrics_address"]

    def scrape() -> str:
        with urlopen(f"http://{address}/metrics", timeout=5) as answer:
            return answer.read().decode()

    text = node.wait_for(
        lambda: (t := scrape()) and 'pod="infer"' in t and 'pod="train"' in t and t,
        what="the allocations in the metrics",
    )
    assert len(doc["allocations"]) == 3
    for a in doc["allocations"]:
        assert a["id"] not in text, f"allocation id {a['id']} leaks through the metrics"
    assert "allocation=" not in text
    quota = [
        line
        for line in text.splitlines()
        if line.startswith("gpushare_allocation_memory_quota_bytes{")
    ]
    assert any('pod="infer"' in line and 'container="side"' in line for line in quota), quota


def test_status_json_and_metrics_carry_isolation_per_allocation(node):
    """Issue 14: every allocation of a running daemon's ``nodemgr status --json`` has its
    ``isolation`` (memory and compute level, a reason each), as computed from what the
    node really has; the table shows the levels and the metrics carry them."""
    from urllib.request import urlopen

    doc = admit_shared_and_whole(node)
    rows = {(a["namespace"], a["pod"], a["container"]): a for a in doc["allocations"]}
    # The stand-in MPS is healthy with its ceiling set, the watchdog kills and reads
    # per-process memory (the simulated cards report none): the quota is enforced, the
    # thread percentage only asked of the client through its env.
    main = rows[("team-a", "infer", "main")]["isolation"]
    assert (main["memory"], main["compute"]) == ("enforced", "advisory")
    assert "watchdog" in main["memory_detail"] and "env" in main["compute_detail"]
    side = rows[("team-a", "infer", "side")]["isolation"]
    assert (side["memory"], side["compute"]) == ("enforced", "unlimited")
    train = rows[("team-b", "train", "main")]["isolation"]
    assert (train["memory"], train["compute"]) == ("exclusive", "exclusive")
    table = node.nodemgr("status").stdout
    assert any(line.startswith("team-a/infer") and "enforced" in line and "advisory" in line
               for line in table.splitlines())  # fmt: skip

    with urlopen(f"http://{doc['daemon']['metrics_address']}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    isolation = [
        line for line in text.splitlines() if line.startswith("gpushare_allocation_isolation{")
    ]
    assert any('pod="infer"' in line and 'container="main"' in line
               and 'memory="enforced"' in line and 'compute="advisory"' in line
               for line in isolation), isolation  # fmt: skip
