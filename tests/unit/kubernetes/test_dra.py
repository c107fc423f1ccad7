"""Pins nodemgr.kubernetes.dra against the test API server (resource.k8s.io/v1 with the
API server's validation): the slice created once, owned by the Node, replaced only when
its content changes (generation + 1) and created again after a wipe; claims' status
entries written and removed, never onto a claim made again; refusals as Events on the
claim's pods."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from nodemgr.domain.model import ClaimRef, ClaimResult
from nodemgr.kubernetes.client import ApiSession, find_credentials, new_api_client
from nodemgr.kubernetes.dra import (
    CLAIM_STATUS,
    ClaimEvents,
    ClaimStatusWriter,
    SliceWriter,
    claim_device_status,
    slice_name,
)
from standins.kubelet_dra import ApiAccess
from standins.ledger_rows import allocation
from tests.unit.kubernetes.support import NODE

DRIVER = "gpushare.aliyun.com"
SHARE = "5b2a4f7e-0000-4000-8000-000000000001"


@pytest.fixture
def session(api, tmp_path):
    credentials = find_credentials(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    made = ApiSession(new_api_client(credentials), 2.0, time.time)
    yield made
    made.close()


def device(name="gpu-a", memory="15Gi"):
    policy = {"default": memory, "validRange": {"min": "1Gi", "max": memory, "step": "1Gi"}}
    return {"name": name, "allowMultipleAllocations": True,
            "attributes": {"index": {"int": 0}},
            "capacity": {"memory": {"value": memory, "requestPolicy": policy}}}  # fmt: skip


def test_the_slice_is_created_owned_by_the_node_and_replaced_only_on_change(api, session):
    """Created at generation 1 with the Node as owner; the same devices write nothing;
    other devices replace it at generation 2; wiped, it is created again at 3."""
    writer = SliceWriter(NODE, DRIVER)
    writer.write(session, ("resource-slice",), [device()])
    [stored] = api.resource_slices(NODE)
    assert stored["metadata"]["name"] == slice_name(NODE, DRIVER)
    [owner] = stored["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"]) == ("Node", api.node(NODE)["metadata"]["uid"])
    assert stored["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    version = stored["metadata"]["resourceVersion"]
    writer.write(session, ("resource-slice",), [device()])  # the same: nothing written
    assert api.resource_slices(NODE)[0]["metadata"]["resourceVersion"] == version
    writer.write(session, ("resource-slice",), [device(memory="9Gi")])
    assert api.resource_slices(NODE)[0]["spec"]["pool"]["generation"] == 2
    ApiAccess(api.url, api.token).delete_slices(NODE)
    writer.write(session, ("resource-slice",), [device(memory="9Gi")])
    assert api.resource_slices(NODE)[0]["spec"]["pool"]["generation"] == 3


def test_a_restarted_publisher_continues_from_the_generation_it_finds(api, session):
    """A new writer (a daemon restart) reads the stored generation and goes past it."""
    SliceWriter(NODE, DRIVER).write(session, ("resource-slice",), [device()])
    SliceWriter(NODE, DRIVER).write(session, ("resource-slice",), [device(memory="8Gi")])
    assert api.resource_slices(NODE)[0]["spec"]["pool"]["generation"] == 2


def claim_in_api(api, share=SHARE):
    api.add_resource_slice({"metadata": {"name": "s"}, "spec": {
        "driver": DRIVER, "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
        "nodeName": NODE, "devices": [device()]}})  # fmt: skip
    api.add_device_class("c", [f'device.driver == "{DRIVER}"'])
    api.add_resource_claim("ns", "c1", [{"name": "gpu", "deviceClassName": "c",
                                         "capacity": {"memory": "2Gi"}}])  # fmt: skip
    return (
        api.allocate_claim("ns", "c1", NODE, new_share_id=None)
        if False
        else api.allocate_claim("ns", "c1", NODE)
    )


def test_claim_status_entries_are_written_removed_and_follow_the_claims_uid(api, session):
    """A Ready condition with the isolation and the amounts in data; an empty list takes
    this driver's entries away; a claim deleted and made again (another UID) is left
    alone."""
    claim = claim_in_api(api)
    result = claim["status"]["allocation"]["devices"]["results"][0]
    api.update_resource_claim("ns", "c1", lambda c: c["status"].update(devices=[]))
    ref = ClaimRef(claim["metadata"]["uid"], "ns", "c1",
                   (ClaimResult("gpu", NODE, "gpu-a", result["shareID"]),))  # fmt: skip
    held = replace(allocation("ga-1"), claim=ref)
    entries = claim_device_status(DRIVER, held, {"memory": "enforced", "compute": "advisory"},
                                  "GPU0 (GPU-a)")  # fmt: skip
    key = (CLAIM_STATUS, "ns", "c1", ref.uid)
    ClaimStatusWriter(DRIVER).write(session, key, entries)
    [mine] = api.resource_claim("ns", "c1")["status"]["devices"]
    assert mine["shareID"] == result["shareID"] and mine["conditions"][0]["type"] == "Ready"
    assert "memory enforced, compute advisory" in mine["conditions"][0]["message"]
    assert mine["data"]["memoryMiB"] == held.memory_mib
    ClaimStatusWriter(DRIVER).write(session, key, [])
    assert not api.resource_claim("ns", "c1")["status"].get("devices")
    wrong = (CLAIM_STATUS, "ns", "c1", "another-uid")
    ClaimStatusWriter(DRIVER).write(session, wrong, entries)  # a claim made again: untouched
    assert not api.resource_claim("ns", "c1")["status"].get("devices")


def test_a_refusal_is_an_event_on_each_pod_the_claim_is_reserved_for():
    """Every pod in reservedFor gets the Event; a claim that could not be read, none."""

    class Adapter:
        events = []

        def record_event(self, namespace, pod, reason, message):
            self.events.append((namespace, pod, reason, message))

    adapter = Adapter()
    pods = [{"resource": "pods", "name": "p1", "uid": "1"}, {"resource": "pods", "name": "p2"}]
    claim = {"status": {"reservedFor": pods}}
    key = ClaimRef("u", "ns", "c", ())
    ClaimEvents(adapter).refused(claim, key, "no room")
    ClaimEvents(adapter).refused(None, key, "unreadable")
    assert adapter.events == [("ns", "p1", "GPUShareClaimRefused", "no room"),
                              ("ns", "p2", "GPUShareClaimRefused", "no room")]  # fmt: skip


def test_a_node_that_turned_dra_off_deletes_the_slice_it_published(api, tmp_path):
    """remove_slice through the adapter's queue: the node's slice goes,
    then the ledger's note is cleared."""
    from nodemgr.config.schema import KubernetesSettings
    from nodemgr.kubernetes.adapter import KubeAdapter
    from nodemgr.kubernetes.dra import remove_slice
    from tests.unit.kubernetes.support import wait_until

    credentials = find_credentials(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    session = ApiSession(new_api_client(credentials), 2.0, time.time)
    SliceWriter(NODE, DRIVER).write(session, ("resource-slice",), [device()])
    session.close()
    settings = KubernetesSettings(
        kubeconfig=str(tmp_path / "kubeconfig"), request_timeout_seconds=2
    )
    adapter = KubeAdapter(settings, NODE, initial_backoff_seconds=0.05, max_backoff_seconds=0.4)
    cleared = []
    try:
        adapter.start()
        remove_slice(adapter, NODE, DRIVER, lambda: cleared.append(True))
        wait_until(lambda: cleared, what="the slice's removal")
        assert api.resource_slices(NODE) == []
    finally:
        adapter.stop()
        adapter.join(2)
