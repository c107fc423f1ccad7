"""Pins DRA claims in the allocation state (nodemgr.allocation.claims and the allocator's
ClaimLedger side): a claim's demand placed on free device IDs of the one ledger both
front doors share, never double booked either way, idempotent, left alone by the device
plugin's reconcile, and refused (nothing recorded) when the scheduler's allocation does
not fit."""

from __future__ import annotations

import pytest

from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.domain.claims import ClaimDemand
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import ClaimRef, ClaimResult, ContainerRef
from nodemgr.errors import ConflictError, NoFitError
from nodemgr.inventory import open_inventory
from standins.cards import GPU0, GPU1
from standins.clock import Clock

MEM, CORE, WHOLE = ResourceKind.MEMORY, ResourceKind.CORE, ResourceKind.WHOLE


@pytest.fixture
def clock():
    return Clock()


def make(settings, clock):
    cards = open_inventory(settings.gpus).cards()
    return Allocator(settings, cards, Ledger(settings.state_dir), clock=clock, monotonic=clock)


@pytest.fixture
def allocator(settings, clock):
    return make(settings, clock)


def share(uid="u1", card=GPU0, units=4, cores=30, name="c1"):
    ref = ClaimRef(uid, "ns", name, (ClaimResult("gpu", "node-a", card.lower(), "s-" + uid),))
    return ClaimDemand(ref, (card,), whole=False, memory_units=units, core_percent=cores)


def whole(uid="w1", cards=(GPU1,)):
    results = tuple(ClaimResult("gpu", "node-a", c.lower(), None) for c in cards)
    return ClaimDemand(ClaimRef(uid, "ns", "w", results), tuple(cards), whole=True)


def unhealthy(allocator, kind):
    return {d.id for d in allocator.devices(kind) if not d.healthy}


def dp_admit(allocator, kind, size):
    free = [d.id for d in allocator.devices(kind) if d.healthy]
    return allocator.allocate(kind, allocator.preferred(kind, free, [], size))


def test_a_share_holds_free_ids_of_its_card_and_the_device_plugin_lists_them_unhealthy(
    allocator,
):
    """4 units + 30 %: the lowest free IDs, Unhealthy for the device plugin (its kubelet
    never hands them out); the card's whole ID Unhealthy (it holds shared work)."""
    allocation, new = allocator.admit_claim(share())
    assert new and allocation.cards == (GPU0,) and allocation.memory_mib == 4096
    assert allocation.memory_units == 4 and allocation.core_percent == 30
    assert unhealthy(allocator, MEM) == set(allocation.devices[MEM])
    assert unhealthy(allocator, CORE) == set(allocation.devices[CORE])
    assert unhealthy(allocator, WHOLE) == {GPU0}


def test_prepare_again_finds_the_same_allocation_and_a_changed_demand_is_refused(allocator):
    """Idempotent: the same demand gives the recorded allocation; another one for the
    same claim UID is a conflict, recorded nothing."""
    first, _ = allocator.admit_claim(share())
    again, new = allocator.admit_claim(share())
    assert again == first and not new
    with pytest.raises(ConflictError, match="was prepared as 4096 MiB"):
        allocator.admit_claim(share(units=5))
    assert allocator.allocations() == [first]


def test_a_claim_that_does_not_fit_beside_device_plugin_pods_is_refused(allocator):
    """A device plugin pod holds 12 GiB of GPU0: a claim asking 4 GiB there does not
    fit; the refusal names card and room; nothing is recorded."""
    dp_admit(allocator, MEM, 12)
    before = allocator.allocations()
    with pytest.raises(NoFitError, match=r"GPU0 .* 3072 MiB \+ 100 % free"):
        allocator.admit_claim(share(units=4))
    assert allocator.allocations() == before


def test_a_whole_card_claim_fences_the_card_and_leaves_no_room_for_shares(allocator):
    """Whole: the card's whole ID and its shared IDs all Unhealthy (the device plugin's
    whole-card list too), MPS leaves it (whole_cards), a share there is refused."""
    allocation, _ = allocator.admit_claim(whole())
    assert allocation.whole and allocation.devices == {WHOLE: (GPU1,)}
    assert GPU1 in unhealthy(allocator, WHOLE) and GPU1 in allocator.whole_cards()
    assert all(i.startswith(GPU1) for i in unhealthy(allocator, MEM))
    with pytest.raises(ConflictError, match="given out whole"):
        allocator.admit_claim(share(uid="u2", card=GPU1))


def test_a_whole_card_claim_on_a_card_with_shares_is_refused(allocator):
    """A card holding a device plugin share cannot be given whole to a claim."""
    dp_admit(allocator, MEM, 2)
    with pytest.raises(ConflictError, match="holds 1 shared allocation"):
        allocator.admit_claim(whole(cards=(GPU0,)))


def test_the_device_plugin_cannot_take_a_claims_ids(allocator):
    """kubelet asking Allocate for IDs a claim holds (it chose from an older list) is
    refused: a claim's devices are never taken over as stale ones are."""
    allocation, _ = allocator.admit_claim(share())
    before = allocator.allocations()
    with pytest.raises(ConflictError, match="held by claim ns/c1"):
        allocator.allocate(MEM, [allocation.devices[MEM][0]])
    assert allocator.allocations() == before


def test_preferred_skips_claim_ids_kubelet_still_lists_free(allocator):
    """GetPreferredAllocation with kubelet's stale free list: no ID a claim holds."""
    allocation, _ = allocator.admit_claim(share(units=14))
    every = [d.id for d in allocator.devices(MEM)]
    picked = allocator.preferred(MEM, every, [], 1)
    assert not set(picked) & set(allocation.devices[MEM])


def test_preferred_whole_card_skips_a_card_a_claim_holds_a_share_of(allocator):
    """A claim's share on GPU0, kubelet's whole-card list not updated yet: the whole card
    preferred is GPU1; with GPU1 taken by a whole claim too, the refusal names the claim."""
    allocator.admit_claim(share())
    assert allocator.preferred(WHOLE, [GPU0, GPU1], [], 1) == [GPU1]
    allocator.admit_claim(whole())
    with pytest.raises(ConflictError) as refused:
        allocator.preferred(WHOLE, [GPU0, GPU1], [], 1)
    message = str(refused.value)
    assert "GPU0" in message and "claim ns/c1" in message
    assert "kubelet's device list was stale" in message


def test_reconcile_leaves_claims_alone_and_never_adopts_their_devices(allocator, clock):
    """Claims are released by NodeUnprepareResources, not by the device plugin's record:
    an empty record past the grace keeps them; a record showing a claim's device for a
    container adopts nothing."""
    allocation, _ = allocator.admit_claim(share())
    clock.now += 3600
    assert allocator.reconcile({}).empty
    ref = ContainerRef("ns", "p", "c")
    plan = allocator.reconcile({ref: {"aliyun.com/gpu-mem": [allocation.devices[MEM][0]]}})
    assert plan.empty and allocator.allocations() == [allocation]


def test_release_frees_the_ids_and_the_ledger_keeps_claims_across_a_restart(settings, clock):
    """A claim survives the daemon's restart (the ledger's claims table); unprepare
    releases it and its IDs are Healthy again."""
    first = make(settings, clock)
    allocation, _ = first.admit_claim(share())
    second = make(settings, clock)
    assert second.claim_allocation("u1") == allocation
    assert second.release_claim("u1") == allocation
    assert second.release_claim("u1") is None
    assert unhealthy(second, MEM) == set() and second.allocations() == []


def test_a_claims_env_and_mounts_are_allocates(allocator):
    """container_edits is Allocate's one source of env and mounts: a claim gets the
    same names, its own allocation id and quota."""
    allocation, _ = allocator.admit_claim(share())
    envs, _ = allocator.container_edits(allocation)
    assert envs["GPUSHARE_ALLOCATION_ID"] == allocation.id
    assert envs["NVIDIA_VISIBLE_DEVICES"] == GPU0
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    result = dp_admit(allocator, MEM, 2)
    dp_env, _ = allocator.container_edits(allocator.allocation(result.allocation_id))
    assert set(dp_env) - set(envs) <= {"ALIYUN_COM_GPU_MEM_POD"}
    assert dp_env == result.envs


def test_a_batch_is_judged_claim_by_claim_and_recorded_in_one_transaction(allocator):
    """Two claims of one call wanting 10 GiB each of GPU0: the first gets the IDs, the
    second sees them taken and is refused; one commit for the batch; the same claim twice
    in a batch is one allocation."""
    commits = []
    real_commit = allocator._ledger.commit
    allocator._ledger.commit = lambda **kw: (commits.append(kw), real_commit(**kw))[1]
    first, second = share("u1", units=10, cores=0), share("u2", units=10, cores=0, name="c2")
    answers = allocator.admit_claims([first, second, first])
    assert answers[0][1] is True and isinstance(answers[1], NoFitError)
    assert answers[2] == (answers[0][0], False)
    assert len(commits) == 1 and [a.claim.uid for a in allocator.allocations()] == ["u1"]
    assert len(unhealthy(allocator, MEM)) == 10
