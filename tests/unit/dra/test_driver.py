"""Pins nodemgr.dra.driver: NodePrepareResources as admission into the real allocation
state (a claim read, judged, recorded, its CDI spec written, its devices answered),
refusals per claim that record nothing, idempotence, the deadline, unprepare, and the
clean-up of CDI specs at start (a spec of an earlier version written again as today's)."""

from __future__ import annotations

import copy
import json
import os

import pytest

from mps.layout import MpsLayout
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.domain import cdi
from nodemgr.dra.cdifiles import CdiDirectory
from nodemgr.dra.driver import ClaimKey, DraDriver
from nodemgr.errors import KubeNotFound, KubeUnavailable
from nodemgr.inventory import open_inventory
from standins.cards import GPU0, GPU1
from standins.clock import Clock

DRIVER = "gpushare.aliyun.com"


def claim_obj(name="c1", uid="11111111-0000-4000-8000-000000000001", card=GPU0, memory="4Gi",
              cores="30", requests=None, share="5b2a4f7e-0000-4000-8000-000000000001"):  # fmt: skip
    requests = requests if requests is not None else {"memory": "4Gi", "cores": "30"}
    exactly = {"deviceClassName": "c"} | ({"capacity": {"requests": requests}} if requests else {})
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
        "status": {
            "allocation": {"devices": {"results": [{
                "request": "gpu", "driver": DRIVER, "pool": "node-a", "device": card.lower(),
                "shareID": share, "consumedCapacity": {"memory": memory, "cores": cores}}]}},
            "reservedFor": [{"resource": "pods", "name": "p1", "uid": "pod-uid"}],
        },
    }  # fmt: skip


class Claims:
    """A ClaimSource over a dict, counting reads; a value that is an exception is raised."""

    def __init__(self):
        self.objects: dict[tuple[str, str], object] = {}
        self.reads = 0

    def add(self, obj):
        self.objects[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj
        return ClaimKey("ns", obj["metadata"]["uid"], obj["metadata"]["name"])

    def read_claim(self, namespace, name):
        self.reads += 1
        found = self.objects.get((namespace, name))
        if found is None:
            raise KubeNotFound("not found", 404)
        if isinstance(found, Exception):
            raise found
        return copy.deepcopy(found)


class Reports:
    def __init__(self):
        self.refusals = []

    def refused(self, claim, key, message):
        self.refusals.append((key, message))


@pytest.fixture
def env(settings, tmp_path):
    class Env:
        clock = Clock()
        allocator = Allocator(settings, open_inventory(settings.gpus).cards(),
                              Ledger(settings.state_dir), clock=clock, monotonic=clock)  # fmt: skip
        claims = Claims()
        reports = Reports()
        cdi_dir = CdiDirectory(str(tmp_path / "cdi"), DRIVER)

        def driver(self, **kwargs):
            return DraDriver(
                driver=DRIVER, pool="node-a", ledger=self.allocator, cards=self.allocator.cards,
                unit_mib=1024, claims=self.claims, cdi_directory=self.cdi_dir,
                reports=self.reports, **kwargs,
            )  # fmt: skip

    return Env()


def test_a_claim_is_recorded_and_answered_with_its_cdi_device(env):
    """The ledger holds it before the answer; the spec's env is Allocate's; the answer
    names base request, pool, device, CDI id and share ID."""
    key = env.claims.add(claim_obj())
    answer = env.driver().prepare([key])
    [device] = answer[key.uid].devices
    [allocation] = env.allocator.allocations()
    assert allocation.claim.uid == key.uid and allocation.memory_mib == 4096
    name = cdi.device_name(key.uid, GPU0.lower(), device.share_id)
    assert device.cdi_ids == (f"{DRIVER}/gpu={name}",)
    assert (device.request_names, device.pool, device.device) == (("gpu",), "node-a", GPU0.lower())
    spec = env.cdi_dir.read(key.uid)
    assert cdi.spec_problems(spec) == []
    env_list = spec["devices"][0]["containerEdits"]["env"]
    assert f"GPUSHARE_ALLOCATION_ID={allocation.id}" in env_list
    assert oct(os.stat(env.cdi_dir.file(key.uid)).st_mode & 0o777) == "0o600"


def test_asked_again_it_answers_the_same_and_rewrites_a_lost_spec(env):
    """Idempotent: same devices, one allocation; a spec file removed meanwhile is back."""
    key = env.claims.add(claim_obj())
    driver = env.driver()
    first = driver.prepare([key])
    os.unlink(env.cdi_dir.file(key.uid))
    assert driver.prepare([key]) == first
    assert len(env.allocator.allocations()) == 1 and env.cdi_dir.read(key.uid) is not None


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        (lambda c: c.update(metadata={**c["metadata"], "uid": "other"}), "deleted and made again"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0].update(device="gpu-x"),
         "does not have"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"].update(
            memory="16Gi"), "the card has"),
    ],
)  # fmt: skip
def test_a_bad_claim_is_refused_alone_recorded_nowhere_and_reported(env, setup, words):
    """One bad claim of a batch: its own error (and a report for its pods); the good
    claim of the same batch is prepared."""
    good = env.claims.add(
        claim_obj("good", uid="22222222-0000-4000-8000-000000000002", card=GPU1,
                  share="5b2a4f7e-0000-4000-8000-000000000002")
    )  # fmt: skip
    obj = claim_obj()
    key = ClaimKey("ns", obj["metadata"]["uid"], "c1")
    setup(obj)
    env.claims.add(obj)
    answer = env.driver().prepare([key, good])
    assert words in answer[key.uid].error and answer[good.uid].error is None
    assert [a.claim.name for a in env.allocator.allocations()] == ["good"]
    assert [k for k, _ in env.reports.refusals] == [key]


def test_an_unreadable_claim_is_an_error_kubelet_retries(env):
    """API server down: an error for the claim (no report: nothing was judged); gone
    from the API: refused as such."""
    env.claims.objects[("ns", "down")] = KubeUnavailable("no answer")
    answer = env.driver().prepare(
        [ClaimKey("ns", "u-down", "down"), ClaimKey("ns", "u-gone", "gone")]
    )
    assert "cannot read claim ns/down" in answer["u-down"].error
    assert "is not in the API server" in answer["u-gone"].error
    assert env.allocator.allocations() == []


def test_a_spec_that_cannot_be_written_releases_what_was_recorded(env, tmp_path):
    """The CDI directory cannot be written: the claim is refused and its allocation,
    made by this call, released."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    env.cdi_dir = CdiDirectory(str(blocker / "cdi"), DRIVER)
    key = env.claims.add(claim_obj())
    answer = env.driver().prepare([key])
    assert "CDI spec cannot be written" in answer[key.uid].error
    assert env.allocator.allocations() == []


def test_claims_past_the_deadline_are_left_out(env):
    """A batch reaching kubelet's deadline: the claims not reached have no entry (kubelet
    asks for them again), the ones done keep theirs."""
    first = env.claims.add(claim_obj())
    second = env.claims.add(claim_obj("c2", uid="33333333-0000-4000-8000-000000000003",
                                      share="5b2a4f7e-0000-4000-8000-000000000003"))  # fmt: skip
    ticks = iter([0.0, 0.0, 5.0, 5.0, 5.0])
    answer = env.driver(clock=lambda: next(ticks)).prepare([first, second], deadline=4.0)
    assert list(answer) == [first.uid]


def test_unprepare_releases_and_an_unknown_claim_is_a_success(env):
    """Released and its spec removed; asked again, or for a claim never prepared: ok."""
    key = env.claims.add(claim_obj())
    driver = env.driver()
    driver.prepare([key])
    assert driver.unprepare([key]) == {key.uid: None}
    assert env.allocator.allocations() == [] and env.cdi_dir.claim_uids() == []
    assert driver.unprepare([key, ClaimKey("ns", "never", "x")]) == {key.uid: None, "never": None}


def test_restore_writes_held_claims_specs_and_removes_stale_ones(env):
    """At start: a held claim's spec is written again, another driver's file and files
    of claims no longer held are left or removed as they should be."""
    key = env.claims.add(claim_obj())
    driver = env.driver()
    driver.prepare([key])
    os.unlink(env.cdi_dir.file(key.uid))
    stale = env.cdi_dir.file("44444444-0000-4000-8000-000000000004")
    with open(stale, "w") as f:
        json.dump({}, f)
    other = os.path.join(env.cdi_dir.path, "other.example.com-gpu_x.json")
    with open(other, "w") as f:
        f.write("{}")
    driver.restore()
    assert env.cdi_dir.claim_uids() == [key.uid] and os.path.exists(other)


def test_restore_rewrites_a_spec_that_gave_the_cards_tmpfs_at_dev_shm(env, settings):
    """A claim prepared by an earlier version, whose spec mounts the card's tmpfs at
    /dev/shm: at start its spec is written again with the client directory alone, so a
    container of that claim started after the upgrade is not refused for it."""
    layout = MpsLayout(settings.run_dir)
    env.allocator = Allocator(settings, open_inventory(settings.gpus).cards(),
                              Ledger(settings.state_dir), clock=env.clock, monotonic=env.clock,
                              mps_layout=layout)  # fmt: skip
    key = env.claims.add(claim_obj())
    driver = env.driver()
    driver.prepare([key])
    spec = env.cdi_dir.read(key.uid)
    edits = spec["devices"][0]["containerEdits"]
    edits["mounts"].append(
        {"hostPath": layout.shm_dir(GPU0), "containerPath": "/dev/shm", "options": ["rbind"]}
    )
    env.cdi_dir.write(key.uid, spec)
    driver.restore()
    [mount] = env.cdi_dir.read(key.uid)["devices"][0]["containerEdits"]["mounts"]
    assert (mount["containerPath"], mount["hostPath"]) == (
        "/tmp/nvidia-mps",
        layout.client_dir(GPU0),
    )
