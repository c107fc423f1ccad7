"""End to end: the real gpushare-node as a DRA kubelet plugin, driven by the test kubelet's
DRA side (standins/kubelet_dra.py) over real unix sockets, claims allocated in the
test API server as kube-scheduler would (standins/dra_allocator.py) from the slice
the daemon published.

Pins registration (v1 first), prepare as admission into the one ledger (the CDI spec,
the device list the device plugin serves, refusals per claim with nothing recorded),
idempotence across kubelet restarts and retries, unprepare, the ResourceSlice (published,
republished after kubelet wipes it, lowered by device plugin pods), and a daemon restart.
"""

from __future__ import annotations

import json
import os

import pytest

from standins.daemon_proc import CORE, GPU0, GPU1, MEMORY, WHOLE
from standins.dra_node import DRIVER, NODE, DraCluster
from standins.kubelet_dra import V1, ApiAccess

pytestmark = pytest.mark.e2e

D0, D1 = GPU0.lower(), GPU1.lower()


@pytest.fixture
def cluster():
    cluster = DraCluster()
    cluster.start()
    yield cluster
    cluster.close()


def env_of(spec) -> dict[str, str]:
    [device] = spec["devices"]
    return dict(entry.split("=", 1) for entry in device["containerEdits"]["env"])


def test_registers_v1_first_and_publishes_one_device_per_card(cluster):
    """GetInfo: DRAPlugin, the driver, the service socket, v1 then v1beta1 (kubelet picks
    v1); the slice: the node's pool, one shareable device per card with memory and cores."""
    [record] = [r for r in cluster.dra.registrations() if r.error is None]
    assert record.service == V1 and record.notified
    assert list(record.info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    spec = cluster.wait_slice()["spec"]
    assert spec["driver"] == DRIVER and spec["nodeName"] == NODE
    assert spec["pool"]["name"] == NODE and spec["pool"]["resourceSliceCount"] == 1
    devices = {d["name"]: d for d in spec["devices"]}
    assert set(devices) == {D0, D1}
    gpu0 = devices[D0]
    assert gpu0["allowMultipleAllocations"] is True
    assert gpu0["attributes"]["uuid"] == {"string": GPU0}
    assert gpu0["capacity"]["memory"]["value"] == "15Gi"
    assert gpu0["capacity"]["cores"]["value"] == "100"


def test_a_claim_is_prepared_into_the_ledger_with_allocates_env_and_unprepared(cluster):
    """4Gi + 30 %: recorded in the ledger before the answer, the CDI spec carries the
    env Allocate gives (quota, pipe directory, allocation id) and the MPS mounts, the
    answer names the CDI id and share ID; the device plugin lists the claim's IDs
    Unhealthy; unprepare releases all of it."""
    pod = cluster.claimed_pod("p1", "c1", {"memory": "4Gi", "cores": "30"})
    assert cluster.dra.prepare_pod(pod).ok
    [allocation] = cluster.node.allocations()
    assert allocation["memory_mib"] == 4096 and allocation["core_percent"] == 30
    env = env_of(cluster.cdi_spec("c1"))
    assert env["GPUSHARE_ALLOCATION_ID"] == allocation["id"]
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["NVIDIA_VISIBLE_DEVICES"] in (GPU0, GPU1)
    mounts = cluster.cdi_spec("c1")["devices"][0]["containerEdits"]["mounts"]
    assert [m["containerPath"] for m in mounts] == ["/tmp/nvidia-mps"]  # no /dev/shm
    [device] = cluster.dra.claims()[("ns", "c1")].drivers[DRIVER]
    result = cluster.claim("c1")["status"]["allocation"]["devices"]["results"][0]
    assert device.share_id == result["shareID"] and device.request_names == ["gpu"]
    uid = cluster.claim("c1")["metadata"]["uid"]
    assert device.cdi_ids == [f"{DRIVER}/gpu={uid}-{result['device']}-{result['shareID']}"]
    card = env["NVIDIA_VISIBLE_DEVICES"]
    listed = cluster.kubelet.wait_for_devices(
        MEMORY, lambda devices: sum(not d.healthy for d in devices) == 4
    )
    assert all(d.id.startswith(card) for d in listed if not d.healthy)
    assert cluster.dra.unprepare_pod(pod).ok
    assert cluster.node.allocations() == []
    assert os.listdir(cluster.cdi_dir) == []


def test_a_claim_that_does_not_fit_is_refused_per_claim_and_nothing_is_recorded(cluster):
    """Device plugin pods fill GPU0's memory after the scheduler placed the claim there
    from the older slice: the claim's prepare fails naming card and room, nothing is
    recorded, and the pod gets an Event saying why."""
    pod = cluster.claimed_pod("p1", "c1", {"memory": "8Gi"})
    card = cluster.claim("c1")["status"]["allocation"]["devices"]["results"][0]["device"]
    assert cluster.dp_admit("dp0", {MEMORY: 8}).ok and cluster.dp_admit("dp1", {MEMORY: 8}).ok
    # One 8 GiB pod per card (15 GiB each): the claim's card keeps 7 GiB.
    assert {a["cards"][0].lower() for a in cluster.node.allocations()} == {D0, D1} and card
    result = cluster.dra.prepare_pod(pod)
    assert not result.ok and "nothing was recorded" in result.error
    assert sorted(a["pod"] for a in cluster.node.allocations()) == ["dp0", "dp1"]
    events = cluster.node.wait_for(
        lambda: [e for e in cluster.api.events() if e.get("reason") == "GPUShareClaimRefused"],
        what="the refusal Event",
    )
    assert events[0]["involvedObject"]["name"] == "p1"


def test_prepare_is_idempotent_across_a_kubelet_restart(cluster):
    """kubelet restarts: it wipes the slice (republished), registers again and prepares
    the running pod's claim again: the same allocation and devices."""
    pod = cluster.claimed_pod("p1", "c1", {"memory": "2Gi", "cores": "10"})
    assert cluster.dra.prepare_pod(pod).ok
    [before] = cluster.node.allocations()
    first = cluster.dra.claims()[("ns", "c1")].drivers[DRIVER][0].cdi_ids
    cluster.kubelet.restart()  # both sides: the DRA side is attached
    cluster.dra.wait_registered(DRIVER, timeout=15)
    cluster.wait_slice(timeout=20)
    assert cluster.dra.prepare_pod(pod).ok
    assert cluster.node.allocations() == [before]
    assert cluster.dra.claims()[("ns", "c1")].drivers[DRIVER][-1].cdi_ids == first


def test_claims_survive_a_daemon_restart(cluster):
    """The daemon restarts: it registers again (new sockets), keeps the claim (ledger),
    answers the same on a new prepare and releases on unprepare."""
    pod = cluster.claimed_pod("p1", "c1", {"memory": "3Gi"})
    assert cluster.dra.prepare_pod(pod).ok
    [before] = cluster.node.allocations()
    cluster.node.stop()
    cluster.dra.wait_for(lambda: cluster.dra.plugins(DRIVER) == [], what="deregistration")
    cluster.node.start()
    cluster.dra.wait_registered(DRIVER, timeout=15)
    assert cluster.node.allocations() == [before]
    with cluster.dra._cond:  # kubelet forgot it was prepared (a kubelet restart too)
        cluster.dra._claims[("ns", "c1")].prepared = False
    assert cluster.dra.prepare_pod(pod).ok
    assert cluster.node.allocations() == [before]
    assert cluster.dra.unprepare_pod(pod).ok and cluster.node.allocations() == []


def test_the_slice_shows_device_plugin_use_and_comes_back_when_deleted(cluster):
    """A device plugin pod holding 6 GiB + 20 % lowers its card's capacities in the
    slice (generation bumped); a slice deleted by kubelet is published again."""
    generation = cluster.wait_slice()["spec"]["pool"]["generation"]
    assert cluster.dp_admit("dp", {MEMORY: 6, CORE: 20}).ok
    [allocation] = cluster.node.allocations()
    device = allocation["cards"][0].lower()

    def lowered(s):
        capacity = {d["name"]: d["capacity"] for d in s["spec"]["devices"]}[device]
        return capacity["memory"]["value"] == "9Gi" and capacity["cores"]["value"] == "80"

    lowered_slice = cluster.wait_slice(lowered)
    assert lowered_slice["spec"]["pool"]["generation"] > generation
    ApiAccess(cluster.api.url, cluster.api.token).delete_slices(NODE)
    assert cluster.api.resource_slices(NODE) == []
    cluster.wait_slice(lowered, timeout=20)


def sound(cluster):
    """nodemgr check-ledger passes (read-only, beside the running daemon)."""
    done = cluster.node.nodemgr("check-ledger", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_both_doors_fill_the_same_cards_through_one_ledger_across_restarts(cluster):
    """Device plugin pods and claims share GPU0 and GPU1: each door sees what the other
    holds (the slice's capacities, the device lists' Unhealthy IDs), nothing is booked
    twice, the ledger stays sound after every step, and the daemon's and kubelet's
    restarts change nothing."""
    assert cluster.dp_admit("dp-a", {MEMORY: 4, CORE: 20}).ok  # binpack: GPU0
    [dp_a] = cluster.node.allocations()
    gpu0 = dp_a["cards"][0].lower()
    sound(cluster)
    cluster.wait_slice(lambda s: {d["name"]: d for d in s["spec"]["devices"]}[gpu0]["capacity"][
        "memory"]["value"] == "11Gi")  # fmt: skip
    pod1 = cluster.claimed_pod("p1", "c1", {"memory": "4Gi", "cores": "30"})
    assert cluster.dra.prepare_pod(pod1).ok
    assert cluster.claim("c1")["status"]["allocation"]["devices"]["results"][0]["device"] == gpu0
    sound(cluster)
    # The device plugin sees the claim's 4 units as Unhealthy: GPU0 has 7 left for it.
    cluster.kubelet.wait_for_devices(
        MEMORY, lambda ds: sum(not d.healthy for d in ds if d.id.lower().startswith(gpu0)) == 4
    )
    assert cluster.dp_admit("dp-b", {MEMORY: 7}).ok
    on_gpu0 = [a for a in cluster.node.allocations() if a["cards"][0].lower() == gpu0]
    assert sum(a["memory_mib"] for a in on_gpu0) == 15 * 1024  # full, not over
    sound(cluster)

    cluster.node.stop()
    cluster.node.start()
    cluster.dra.wait_registered(DRIVER, timeout=15)
    for resource in (MEMORY, CORE, WHOLE):
        cluster.kubelet.wait_for_resource(resource, timeout=20)
    assert len(cluster.node.allocations()) == 3
    sound(cluster)
    cluster.kubelet.restart()  # both of kubelet's sides (the DRA side is attached)
    cluster.dra.wait_registered(DRIVER, timeout=15)
    assert cluster.dra.prepare_pod(pod1).ok  # prepared again after kubelet's restart
    assert len(cluster.node.allocations()) == 3
    sound(cluster)

    # The scheduler sees GPU0 full (its slice says 4Gi left, the claim holds 4Gi): 8Gi
    # goes to GPU1. A whole card fits nowhere now.
    cluster.wait_slice(timeout=20)
    pod2 = cluster.claimed_pod("p2", "c2", {"memory": "8Gi"})
    assert cluster.claim("c2")["status"]["allocation"]["devices"]["results"][0]["device"] != gpu0
    assert cluster.dra.prepare_pod(pod2).ok
    from standins.dra_allocator import AllocationError

    with pytest.raises(AllocationError):
        cluster.claimed_pod("p3", "c3")
    assert sound(cluster)["allocations"] == 4
    for pod in (pod1, pod2):
        assert cluster.dra.unprepare_pod(pod).ok
    assert sorted(a["pod"] for a in cluster.node.allocations()) == ["dp-a", "dp-b"]
    sound(cluster)


def test_a_lost_ledger_takes_the_prepared_claims_back_from_their_cdi_specs(cluster):
    """The ledger moved aside while the daemon was stopped: at start the claim is taken
    back from its CDI spec and kubelet's record under its old allocation ID (its
    containers' env stays valid); kubelet's next prepare finds it and teaches it the
    request names; unprepare releases it."""
    pod = cluster.claimed_pod("p1", "c1", {"memory": "3Gi", "cores": "20"})
    assert cluster.dra.prepare_pod(pod).ok
    [before] = cluster.node.allocations()
    cluster.node.stop()
    state = os.path.join(cluster.node.root, "state")
    for name in os.listdir(state):
        os.rename(os.path.join(state, name), os.path.join(state, "lost-" + name))
    cluster.node.start()
    cluster.dra.wait_registered(DRIVER, timeout=15)
    [after] = cluster.node.allocations()
    assert (after["id"], after["memory_mib"], after["core_percent"], after["cards"]) == (
        before["id"], 3072, 20, before["cards"])  # fmt: skip
    assert after["claim"] == before["claim"]
    assert "recovered 1 of 1 prepared claims" in cluster.node.log()
    sound(cluster)
    cluster.kubelet.restart()
    cluster.dra.wait_registered(DRIVER, timeout=15)
    assert cluster.dra.prepare_pod(pod).ok
    assert [a["id"] for a in cluster.node.allocations()] == [before["id"]]
    assert cluster.dra.unprepare_pod(pod).ok and cluster.node.allocations() == []
