"""Pins the allocator: one card for a container's memory and share (whichever comes
first), env contents, linkage between whole and shared cards, and clear refusals
that change nothing.

Why this module is longer than 400 lines: the allocator is the one owner of the
allocation state; its admission, placement, carry-over and reconcile paths are pinned
here together because they share one fixture and one state.
"""

from dataclasses import replace

import pytest

from nodemgr.allocation.admission import ADMISSION_WINDOW_SECONDS
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.domain.deviceids import ResourceKind, card_device_ids, card_of
from nodemgr.domain.model import ContainerRef
from nodemgr.errors import ConflictError, LedgerError, NoFitError, UnknownDeviceError
from nodemgr.inventory import open_inventory
from standins.cards import GPU0, GPU1, simulated_settings
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


def free(allocator, kind):
    held = {key for a in allocator.allocations() for key in a.device_pairs()}
    return [d.id for d in allocator.devices(kind) if d.healthy and (kind, d.id) not in held]


def admit(allocator, requests):
    """What kubelet does for one container: per resource, preferred then Allocate."""
    results = {}
    for kind, size in requests:
        ids = allocator.preferred(kind, free(allocator, kind), [], size)
        results[kind] = allocator.allocate(kind, ids)
    return results


def test_device_counts_of_two_15_gib_cards(allocator):
    assert len(allocator.devices(MEM)) == 30
    assert len(allocator.devices(CORE)) == 200
    assert [d.id for d in allocator.devices(WHOLE)] == [GPU0, GPU1]


@pytest.mark.parametrize("order", [[(MEM, 4), (CORE, 30)], [(CORE, 30), (MEM, 4)]])
def test_memory_and_share_land_on_one_card_whichever_comes_first(allocator, order):
    results = admit(allocator, order)
    mem_env, core_env = results[MEM].envs, results[CORE].envs
    assert mem_env["NVIDIA_VISIBLE_DEVICES"] == core_env["NVIDIA_VISIBLE_DEVICES"] == GPU0
    assert results[MEM].allocation_id == results[CORE].allocation_id
    second = core_env if order[0][0] is MEM else mem_env
    assert second["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert second["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert second["ALIYUN_COM_GPU_MEM_IDX"] == "0"
    assert second["ALIYUN_COM_GPU_MEM_CONTAINER"] == "4"
    assert second["ALIYUN_COM_GPU_MEM_DEV"] == "15"
    assert "ALIYUN_COM_GPU_MEM_POD" not in second  # unknown without the API: left out
    # The first response carries no placeholder for what was not known yet.
    first = mem_env if order[0][0] is MEM else core_env
    unknown = (
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
        if order[0][0] is MEM
        else "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
    )
    assert unknown not in first
    for name in first:  # where they overlap, the two responses agree
        assert first[name] == second[name]
    [allocation] = allocator.allocations()
    assert allocation.memory_mib == 4096 and allocation.core_percent == 30


def test_binpack_puts_the_second_container_on_the_same_card(allocator, clock):
    admit(allocator, [(MEM, 4), (CORE, 30)])
    clock.now += 1
    second = admit(allocator, [(MEM, 4), (CORE, 30)])
    assert second[MEM].envs["NVIDIA_VISIBLE_DEVICES"] == GPU0
    assert len(allocator.allocations()) == 2


def test_allocation_count_follows_admissions(allocator, clock):
    """allocation_count (the run loop's STATUS= line) is the number of allocations."""
    assert allocator.allocation_count() == 0
    admit(allocator, [(MEM, 4), (CORE, 30)])
    assert allocator.allocation_count() == 1
    clock.now += 1
    admit(allocator, [(MEM, 2)])
    assert allocator.allocation_count() == len(allocator.allocations()) == 2


def test_spread_puts_the_second_container_on_the_other_card(tmp_path, clock):
    allocator = make(simulated_settings(str(tmp_path), placement="spread"), clock)
    admit(allocator, [(MEM, 4), (CORE, 30)])
    second = admit(allocator, [(MEM, 4), (CORE, 30)])
    assert second[MEM].envs["NVIDIA_VISIBLE_DEVICES"] == GPU1


def test_too_big_for_any_card_is_refused_and_changes_nothing(allocator):
    with pytest.raises(
        NoFitError,
        match=r"no single GPU on node-a has 16 GiB free: GPU0 "
        r"\(Tesla T4\) has 15 GiB/100% free, GPU1",
    ):
        allocator.preferred(MEM, free(allocator, MEM), [], 16)
    # kubelet may still call Allocate with IDs it picked itself, across cards.
    spanning = card_device_ids(MEM, GPU0, 15) + card_device_ids(MEM, GPU1, 1)
    with pytest.raises(NoFitError, match="one container's share must be on one card"):
        allocator.allocate(MEM, spanning)
    assert allocator.allocations() == []
    assert all(d.healthy for d in allocator.devices(WHOLE))


def test_second_resource_that_no_longer_fits_the_carried_card_is_refused(allocator, clock):
    admit(allocator, [(CORE, 80)])  # another pod holds 80 % of GPU0
    clock.now += ADMISSION_WINDOW_SECONDS + 1
    admit(allocator, [(MEM, 2)])  # binpack: GPU0, the fullest card that fits 2 GiB
    with pytest.raises(NoFitError, match="already placed on GPU0"):
        allocator.preferred(CORE, free(allocator, CORE), [], 30)
    # The carry-over is dropped, so the next pod is placed afresh.
    assert admit(allocator, [(CORE, 30)])[CORE].envs["NVIDIA_VISIBLE_DEVICES"] == GPU1


def test_ids_from_two_resources_that_disagree_are_refused(allocator):
    allocator.allocate(MEM, card_device_ids(MEM, GPU0, 4))
    with pytest.raises(ConflictError, match="both must be on one card"):
        allocator.allocate(CORE, card_device_ids(CORE, GPU1, 100)[:30])


def test_unrelated_pod_after_the_window_is_not_linked(allocator, clock):
    admit(allocator, [(MEM, 4)])
    clock.now += ADMISSION_WINDOW_SECONDS + 1
    admit(allocator, [(CORE, 30)])
    assert len(allocator.allocations()) == 2


def test_unknown_device_ids_are_refused(allocator):
    with pytest.raises(UnknownDeviceError, match="unknown device IDs"):
        allocator.allocate(MEM, ["GPU-nope-_-0"])
    with pytest.raises(UnknownDeviceError):
        allocator.allocate(MEM, [f"{GPU0}-_-15"])  # past the card's 15 units
    with pytest.raises(UnknownDeviceError):
        allocator.allocate(CORE, [f"{GPU0}-_-0"])  # a memory ID sent to the share resource


def test_linkage_shared_card_is_unhealthy_for_whole_and_back_when_freed(allocator, clock):
    admit(allocator, [(MEM, 4)])
    assert {d.id: d.healthy for d in allocator.devices(WHOLE)} == {GPU0: False, GPU1: True}
    clock.now += 100  # past the grace period, and kubelet does not report it
    allocator.reconcile({})
    assert all(d.healthy for d in allocator.devices(WHOLE))


def test_linkage_whole_card_is_unhealthy_for_shared_resources(allocator):
    result = allocator.allocate(WHOLE, [GPU1])
    assert result.envs == {
        "NVIDIA_VISIBLE_DEVICES": GPU1,
        "GPUSHARE_ALLOCATION_ID": result.allocation_id,
    }
    for kind in (MEM, CORE):
        health = {d.id.split("-_-")[0]: d.healthy for d in allocator.devices(kind)}
        assert health == {GPU0: True, GPU1: False}
    with pytest.raises(ConflictError, match="given out whole"):
        allocator.allocate(MEM, card_device_ids(MEM, GPU1, 1))


def test_card_holding_shared_work_cannot_be_given_out_whole(allocator):
    admit(allocator, [(MEM, 1)])
    with pytest.raises(ConflictError, match="holds shared allocations"):
        allocator.allocate(WHOLE, [GPU0])


def test_whole_card_preferred_skips_cards_holding_shared_work_on_a_stale_list(allocator):
    """kubelet's whole-card list still shows GPU0 healthy (the ListAndWatch update marking it
    Unhealthy is in flight) after a share landed there: GetPreferredAllocation picks GPU1,
    which Allocate then gives (GPU0 would be refused, and the pod failed for good)."""
    admit(allocator, [(MEM, 2)])  # GPU0 holds shared work
    picked = allocator.preferred(WHOLE, [GPU0, GPU1], [], 1)
    assert picked == [GPU1]
    assert allocator.allocate(WHOLE, picked).envs["NVIDIA_VISIBLE_DEVICES"] == GPU1


def test_whole_card_refused_clearly_when_every_offered_card_holds_shared_work(tmp_path, clock):
    """Every card kubelet offers whole holds shared work (its list was stale): the refusal
    names the cards, what they hold and that kubelet's device list was stale; Allocate of
    such a card says the same. Nothing changes."""
    allocator = make(simulated_settings(str(tmp_path), placement="spread"), clock)
    admit(allocator, [(MEM, 2)])
    admit(allocator, [(MEM, 2)])  # spread: one share on each card
    before = allocator.allocations()
    for call in (
        lambda: allocator.preferred(WHOLE, [GPU0, GPU1], [], 1),
        lambda: allocator.allocate(WHOLE, [GPU1]),
    ):
        with pytest.raises(ConflictError) as refused:
            call()
        message = str(refused.value)
        assert "GPU1" in message and "holds shared allocations (1)" in message
        assert "kubelet's device list was stale" in message
    assert allocator.allocations() == before


def test_two_whole_cards_refused_when_only_one_offered_card_is_free_of_shared_work(allocator):
    """Two whole cards asked, one of the two offered holds a share: refused naming it
    (filling up with it would only move the refusal to Allocate)."""
    admit(allocator, [(MEM, 2)])
    with pytest.raises(ConflictError, match=r"GPU0 \(.*\) holds shared allocations \(1\)"):
        allocator.preferred(WHOLE, [GPU0, GPU1], [], 2)


def test_shares_preferred_off_a_card_given_out_whole_on_a_stale_list(allocator):
    """kubelet's memory list still shows GPU0's IDs healthy after GPU0 was given out whole:
    the share goes to GPU1; when only the whole card's IDs would fit, the refusal says
    kubelet's device list was stale."""
    allocator.allocate(WHOLE, [GPU0])
    every = [d.id for d in allocator.devices(MEM)]  # as before the whole card was given
    picked = allocator.preferred(MEM, every, [], 4)
    assert {card_of(MEM, i) for i in picked} == {GPU1}
    admit(allocator, [(MEM, 14)])  # GPU1 is nearly full now
    stale = every[:15] + [i for i in free(allocator, MEM) if card_of(MEM, i) == GPU1]
    with pytest.raises(NoFitError) as refused:
        allocator.preferred(MEM, stale, [], 4)
    assert "GPU0" in str(refused.value) and "given out whole" in str(refused.value)
    assert "kubelet's device list was stale" in str(refused.value)
    with pytest.raises(ConflictError, match="kubelet's device list was stale"):
        allocator.allocate(MEM, every[:4])


def test_whole_cards_preferred_by_index_and_envs_list_all(allocator):
    assert allocator.preferred(WHOLE, [GPU1, GPU0], [], 2) == [GPU0, GPU1]
    envs = allocator.allocate(WHOLE, [GPU1, GPU0]).envs
    assert envs["NVIDIA_VISIBLE_DEVICES"] == f"{GPU0},{GPU1}"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in envs


def test_state_survives_a_new_allocator_on_the_same_ledger(settings, clock):
    first = make(settings, clock)
    admit(first, [(MEM, 4), (CORE, 30)])
    before = [(d.id, d.healthy) for d in first.devices(WHOLE)]
    again = make(settings, clock)
    assert again.allocations() == first.allocations()
    assert [(d.id, d.healthy) for d in again.devices(WHOLE)] == before


def test_kubelet_reassigning_a_stale_device_takes_it_from_the_stale_holder(allocator, clock):
    admit(allocator, [(MEM, 2)])
    clock.now += ADMISSION_WINDOW_SECONDS + 1
    # kubelet freed the pod (our reconcile has not run yet) and hands the IDs out again.
    result = allocator.allocate(MEM, card_device_ids(MEM, GPU0, 1))
    remaining = {a.id: a for a in allocator.allocations()}
    assert remaining[result.allocation_id].memory_units == 1
    [stale] = [a for i, a in remaining.items() if i != result.allocation_id]
    assert stale.memory_units == 1 and stale.memory_mib == 1024


def test_reconcile_fills_owner_from_kubelet(allocator):
    result = admit(allocator, [(MEM, 4)])[MEM]
    [allocation] = allocator.allocations()
    ref = ContainerRef("ml", "notebook-0", "jupyter")
    allocator.reconcile({ref: {"aliyun.com/gpu-mem": list(allocation.devices[MEM])}})
    [confirmed] = allocator.allocations()
    assert confirmed.id == result.allocation_id and confirmed.owner == ref


def planned(allocator, monkeypatch) -> list[int]:
    """Counts the reconcile plans the allocator makes from now on (one item per plan, a
    full walk or one over what changed)."""
    import nodemgr.allocation.allocator as module

    calls: list[int] = []
    for name in ("plan_reconcile", "plan_scoped"):
        real = getattr(module, name)

        def counting(*args, real=real, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
    return calls


def test_an_unchanged_record_against_an_unchanged_settled_ledger_is_not_planned_again(
    allocator, clock, monkeypatch
):
    """The periodic reconcile of an idle node costs no plan: once a reconcile changed
    nothing with every allocation confirmed, the same record is skipped (later, too); an
    Allocate or a different record plans again."""
    admit(allocator, [(MEM, 4)])
    [allocation] = allocator.allocations()
    ref = ContainerRef("ml", "notebook-0", "jupyter")
    record = {ref: {"aliyun.com/gpu-mem": list(allocation.devices[MEM])}}
    allocator.reconcile(record)  # confirms it (a change)
    plans = planned(allocator, monkeypatch)
    assert allocator.reconcile(record).empty  # nothing to change: settled
    assert len(plans) == 1
    clock.now += 3600
    assert allocator.reconcile(record).empty
    assert len(plans) == 1
    admit(allocator, [(MEM, 2)])
    allocator.reconcile(record)
    assert len(plans) == 2
    assert allocator.reconcile({}).delete  # the pods are gone: released, not skipped


def test_the_very_record_settled_last_time_is_not_walked_again(allocator, monkeypatch):
    """PodResourcesClient hands back the same record object while kubelet's answer is
    unchanged: once settled, that object against an unchanged ledger is skipped before its
    device IDs are read; an equal but new record is read again, and after an Allocate the
    same object is planned again."""
    admit(allocator, [(MEM, 4)])
    [allocation] = allocator.allocations()
    ref = ContainerRef("ml", "notebook-0", "jupyter")
    record = {ref: {"aliyun.com/gpu-mem": list(allocation.devices[MEM])}}
    allocator.reconcile(record)  # confirms it (a change)
    allocator.reconcile(record)  # settles
    reads: list[str] = []
    real_is_known = allocator._is_known
    monkeypatch.setattr(
        allocator, "_is_known", lambda kind, i: reads.append(i) or real_is_known(kind, i)
    )
    plans = planned(allocator, monkeypatch)
    assert allocator.reconcile(record).empty
    assert reads == [] and plans == []
    equal = {ref: {"aliyun.com/gpu-mem": list(allocation.devices[MEM])}}
    assert allocator.reconcile(equal).empty
    assert len(reads) == 4 and plans == []  # read, found settled: no plan
    admit(allocator, [(MEM, 2)])
    allocator.reconcile(equal)
    assert len(plans) == 1


def test_reconcile_plans_outside_the_lock_and_again_when_the_state_moved(
    allocator, clock, monkeypatch
):
    """The plan (a walk over every allocation) is made without the allocator's lock, so
    Allocate does not wait for it; an Allocate that lands meanwhile makes it plan again
    under the lock, so the newcomer is judged as it is (fresh: kept) while the one whose
    grace ran out is released."""
    import nodemgr.allocation.allocator as module

    admit(allocator, [(MEM, 2)])
    [old] = allocator.allocations()
    clock.now += 3600
    real = module.plan_reconcile
    locked_at_call: list[bool] = []

    def planning(*args, **kwargs):
        locked_at_call.append(allocator._lock.locked())
        if len(locked_at_call) == 1:
            admit(allocator, [(MEM, 1)])  # an Allocate while the plan is made
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "plan_reconcile", planning)
    plan = allocator.reconcile({})
    assert locked_at_call == [False, True]
    assert plan.delete == [old.id]
    [kept] = allocator.allocations()
    assert kept.id != old.id


def test_an_unconfirmed_allocation_is_released_after_its_grace_with_the_same_record(
    allocator, clock
):
    """Nothing is skipped while an allocation waits for kubelet: with an unchanged (empty)
    record it is kept within the grace and released after it."""
    admit(allocator, [(MEM, 2)])
    assert allocator.reconcile({}).empty  # fresh: within the grace
    assert allocator.reconcile({}).empty
    clock.now += 3600
    assert len(allocator.reconcile({}).delete) == 1
    assert allocator.allocations() == []


def judged(monkeypatch) -> list[str]:
    """The IDs of the allocations reconcile compares with kubelet's record from now on."""
    import nodemgr.domain.reconcile as module

    seen: list[str] = []
    real = module._reconcile_one

    def judging(allocation, *args, **kwargs):
        seen.append(allocation.id)
        return real(allocation, *args, **kwargs)

    monkeypatch.setattr(module, "_reconcile_one", judging)
    return seen


def settled_node(allocator, pods: int) -> dict:
    """``pods`` one-unit pods admitted, reported by kubelet and reconciled until nothing is
    left to change; kubelet's record of them."""
    record = {}
    for n in range(pods):
        result = admit(allocator, [(MEM, 1)])[MEM]
        allocation = allocator.allocation(result.allocation_id)
        record[ContainerRef("ns", f"fill-{n}", "main")] = {
            "aliyun.com/gpu-mem": list(allocation.devices[MEM])
        }
    allocator.reconcile(record)  # confirms them
    allocator.reconcile(record)  # judges the confirmed ones once more: nothing to change
    return record


def test_a_reconcile_judges_what_changed_not_every_allocation(allocator, clock, monkeypatch):
    """With 20 settled pods, a new unreported allocation is judged once after its Allocate,
    nothing is judged while it waits within its grace, and it alone is judged (and
    released) once its grace ran out; the settled ones are never walked again."""
    record = settled_node(allocator, 20)
    seen = judged(monkeypatch)
    new = admit(allocator, [(MEM, 1)])[MEM].allocation_id
    assert allocator.reconcile(record).empty
    assert seen == [new]
    clock.now += 30
    assert allocator.reconcile(record).empty
    assert seen == [new]  # waiting within its grace: nothing judged
    clock.now += 31
    assert allocator.reconcile(record).delete == [new]
    assert seen == [new, new]
    assert allocator.allocation_count() == 20


def test_a_changed_record_judges_the_holders_of_the_devices_that_changed(allocator, monkeypatch):
    """A pod gone from kubelet's record (a new record object) releases its allocation, and
    only that allocation is judged; an equal record object judges nothing."""
    record = settled_node(allocator, 20)
    gone = ContainerRef("ns", "fill-7", "main")
    [holder] = [a for a in allocator.allocations() if a.owner == gone]
    seen = judged(monkeypatch)
    fewer = {ref: held for ref, held in record.items() if ref != gone}
    assert allocator.reconcile(fewer).delete == [holder.id]
    assert seen == [holder.id]
    assert allocator.reconcile(dict(fewer)).empty
    assert seen == [holder.id]


def test_changing_the_memory_unit_under_live_allocations_is_refused(tmp_path, clock):
    allocator = make(simulated_settings(str(tmp_path)), clock)
    admit(allocator, [(MEM, 2)])
    with pytest.raises(LedgerError, match="memory_unit_mib is 512 but 1 live allocations"):
        make(simulated_settings(str(tmp_path), memory_unit_mib=512), clock)


def test_whole_resource_can_be_switched_off(tmp_path, clock):
    allocator = make(simulated_settings(str(tmp_path), whole=""), clock)
    assert WHOLE not in allocator.resource_names


def test_incremental_usage_always_equals_a_full_recount(allocator, clock):
    """Admission reads running per-card totals and which shared resources each container
    holds; they must never drift from a full recount of the ledger."""
    import random

    from nodemgr.allocation.usage import CardUsage

    rng = random.Random(7)
    refs = {}
    for step in range(150):
        clock.now += rng.choice([0.1, ADMISSION_WINDOW_SECONDS + 1])
        kind = rng.choice([MEM, CORE, WHOLE])
        size = rng.randint(1, 3 if kind is not WHOLE else 1)
        if len(free(allocator, kind)) < size:
            continue  # kubelet refuses by itself before calling the plugin
        try:
            result = admit(allocator, [(kind, size)])
            refs[result[kind].allocation_id] = ContainerRef("ns", f"p{step}", "c")
        except (NoFitError, ConflictError):
            pass
        if rng.random() < 0.2:  # kubelet drops some pods; reconcile releases them
            live = {a.id: a for a in allocator.allocations()}
            keep = [i for i in live if rng.random() < 0.7]
            record = {}
            for allocation_id in keep:
                ref = refs.get(allocation_id, ContainerRef("ns", allocation_id, "c"))
                for kind_, ids in live[allocation_id].devices.items():
                    name = allocator.resource_names[kind_]
                    record.setdefault(ref, {}).setdefault(name, []).extend(ids)
            allocator.reconcile(record)
        fresh = CardUsage()
        for allocation in allocator.allocations():
            fresh.add(allocation)
        usage = allocator._usage
        assert usage.holders == fresh.holders
        for field in ("memory_units", "core_percent", "shared_allocations", "whole_allocations"):
            assert +getattr(usage, field) == +getattr(fresh, field), field
        assert usage.held_kinds == fresh.held_kinds


# --- with the pods of the node known (the Kubernetes API's pod cache) ------------------------

import threading  # noqa: E402 (the section's own imports)

from nodemgr.domain.extenderchoice import choice_from_annotations  # noqa: E402
from nodemgr.domain.podmatch import ContainerRequest, PodInfo  # noqa: E402

MEM_NAME, CORE_NAME = "aliyun.com/gpu-mem", "aliyun.com/gpu-core.percentage"


class Pods:
    """A PodSource as the Kubernetes adapter gives it: candidate pods, generation, wait."""

    def __init__(self, *pods, live=True):
        self.pods = list(pods)
        self.others: list[PodInfo] = []  # bound here but not candidates (running, ...)
        self.live = live
        self.generation = 0
        self.changed = threading.Condition()

    def candidates(self):
        return list(self.pods)

    def pod(self, namespace, name):
        return next(
            (p for p in (*self.pods, *self.others) if (p.namespace, p.name) == (namespace, name)),
            None,
        )

    def candidates_asking(self, resource, size):
        return tuple(
            p
            for p in self.pods
            if any(c.requests.get(resource) == size for c in (*p.init_containers, *p.containers))
        )

    def add(self, pod):
        with self.changed:
            self.pods.append(pod)
            self.generation += 1
            self.changed.notify_all()

    def wait_for_change(self, seen, timeout):
        with self.changed:
            self.changed.wait_for(lambda: self.generation != seen, timeout)
            return self.generation


def gpu_pod(name, *containers, annotations=None, created=100.0):
    """A pending pod; its gpushare annotations are believed (``placement_trust:
    annotations``): these tests are about honouring a choice, not about whose it is."""
    return PodInfo(
        namespace="ns",
        name=name,
        uid=f"uid-{name}",
        node_name="node-a",
        phase="Pending",
        created_at=created,
        deleting=False,
        annotations=annotations or {},
        containers=tuple(ContainerRequest(n, r) for n, r in containers),
        choice=choice_from_annotations(annotations or {})[0],
    )


def with_pods(settings, clock, pods, on_refusal=None):
    cards = open_inventory(settings.gpus).cards()
    return Allocator(
        settings,
        cards,
        Ledger(settings.state_dir),
        clock=clock,
        monotonic=clock,
        pods=pods,
        on_refusal=on_refusal,
    )


@pytest.mark.parametrize("order", [[(MEM, 4), (CORE, 40)], [(CORE, 40), (MEM, 4)]])
def test_whole_demand_lands_on_the_card_that_fits_both_whichever_comes_first(
    settings, clock, order
):
    pods = Pods(gpu_pod("busy", ("main", {MEM_NAME: 2, CORE_NAME: 70})))
    allocator = with_pods(settings, clock, pods)
    admit(allocator, [(MEM, 2), (CORE, 70)])  # GPU0: 2 GiB and 70 % taken: 30 % share left
    assert [a.cards for a in allocator.allocations()] == [(GPU0,)]
    pods.pods = [gpu_pod("job", ("main", {MEM_NAME: 4, CORE_NAME: 40}), created=200.0)]
    results = admit(allocator, order)
    # binpack alone would put 4 GiB on the fuller GPU0; the share cannot follow it there
    assert results[MEM].envs["NVIDIA_VISIBLE_DEVICES"] == GPU1
    assert results[CORE].envs["NVIDIA_VISIBLE_DEVICES"] == GPU1
    job = next(a for a in allocator.allocations() if a.owner and a.owner.pod == "job")
    assert (job.memory_units, job.core_percent, job.confirmed_at) == (4, 40, None)
    assert results[order[1][0]].envs["ALIYUN_COM_GPU_MEM_POD"] == "4"


def test_second_resource_joins_its_container_without_a_time_window(settings, clock):
    pods = Pods(gpu_pod("slow", ("main", {MEM_NAME: 3, CORE_NAME: 20})))
    allocator = with_pods(settings, clock, pods)
    first = admit(allocator, [(MEM, 3)])[MEM]
    clock.now += ADMISSION_WINDOW_SECONDS * 10  # a very slow kubelet
    second = admit(allocator, [(CORE, 20)])[CORE]
    assert first.allocation_id == second.allocation_id
    assert len(allocator.allocations()) == 1


def test_a_container_refused_its_second_resource_does_not_keep_its_first(settings, clock):
    """Issue 15 item 6 (one allocation more than pods after the footprint bench's fill): kubelet
    fails a pod whose second resource is refused, and never reports the first; the daemon
    released that first allocation only after allocation_grace_seconds. With the pod
    known, the refusal releases it at once; a later pod gets the room."""
    pods = Pods(gpu_pod("late", ("main", {MEM_NAME: 2, CORE_NAME: 40})))
    allocator = with_pods(settings, clock, pods)
    memory = admit(allocator, [(MEM, 2)])[MEM]
    [held] = allocator.allocations()
    card = held.cards[0]
    # kubelet offers fewer of that card's share IDs than asked (its view is the truth)
    offered = [i for i in free(allocator, CORE) if card_of(CORE, i) == card][:10]
    with pytest.raises(NoFitError, match="already holds its other GPU resource"):
        allocator.preferred(CORE, offered, [], 40)
    assert allocator.allocation(memory.allocation_id) is None
    assert allocator.allocations() == []


def test_without_the_pod_a_refused_second_resource_keeps_the_first_until_its_grace(settings, clock):
    """Without the API the link between two resources is a guess (a share-only pod may follow
    a memory-only one): a refusal then releases nothing; reconcile's grace does."""
    allocator = make(settings, clock)
    admit(allocator, [(MEM, 2)])
    [held] = allocator.allocations()
    card = held.cards[0]
    offered = [i for i in free(allocator, CORE) if card_of(CORE, i) == card][:10]
    with pytest.raises(NoFitError):
        allocator.preferred(CORE, offered, [], 40)
    assert [a.id for a in allocator.allocations()] == [held.id]


def test_each_container_of_a_multi_container_pod_gets_its_own_fitting_card(settings, clock):
    two = gpu_pod("two", ("a", {MEM_NAME: 12}), ("b", {MEM_NAME: 10}))
    allocator = with_pods(settings, clock, Pods(two))
    a = admit(allocator, [(MEM, 12)])[MEM]
    b = admit(allocator, [(MEM, 10)])[MEM]
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] != b.envs["NVIDIA_VISIBLE_DEVICES"]
    owners = {a.owner.container: a.cards[0] for a in allocator.allocations()}
    assert set(owners) == {"a", "b"}
    assert a.envs["ALIYUN_COM_GPU_MEM_POD"] == b.envs["ALIYUN_COM_GPU_MEM_POD"] == "22"


def test_extender_card_is_honoured_and_a_stale_choice_is_refused_clearly(settings, clock):
    chosen = gpu_pod("pinned", ("main", {MEM_NAME: 2}), annotations={"ALIYUN_COM_GPU_MEM_IDX": "1"})
    refusals = []
    allocator = with_pods(
        settings,
        clock,
        Pods(chosen),
        on_refusal=lambda demand, message: refusals.append((demand.pod, message)),
    )
    assert admit(allocator, [(MEM, 2)])[MEM].envs["NVIDIA_VISIBLE_DEVICES"] == GPU1
    full = gpu_pod("stale", ("main", {MEM_NAME: 14}), annotations={"ALIYUN_COM_GPU_MEM_IDX": "1"})
    allocator._pods.pods = [full]
    before = allocator.allocations()
    with pytest.raises(NoFitError) as refused:
        admit(allocator, [(MEM, 14)])
    assert "the scheduler extender chose GPU1 for ns/stale/main" in str(refused.value)
    assert "13 GiB/100% free" in str(refused.value)
    assert allocator.allocations() == before
    assert refusals and refusals[0][0] == "stale"


def test_waits_briefly_for_the_pod_watch_then_matches(settings):
    import time

    pods = Pods()
    allocator = Allocator(
        settings, open_inventory(settings.gpus).cards(), Ledger(settings.state_dir), pods=pods
    )
    late = gpu_pod("late", ("main", {MEM_NAME: 5, CORE_NAME: 10}))
    threading.Timer(0.2, pods.add, args=(late,)).start()
    started = time.monotonic()
    result = admit(allocator, [(MEM, 5)])[MEM]
    assert 0.15 < time.monotonic() - started < 1.0
    assert result.envs["ALIYUN_COM_GPU_MEM_POD"] == "5"


def test_no_wait_when_the_watch_is_not_live(settings):
    import time

    allocator = Allocator(
        settings,
        open_inventory(settings.gpus).cards(),
        Ledger(settings.state_dir),
        pods=Pods(live=False),
    )
    started = time.monotonic()
    result = admit(allocator, [(MEM, 5)])[MEM]
    assert time.monotonic() - started < 0.5
    assert "ALIYUN_COM_GPU_MEM_POD" not in result.envs  # pod unknown: left out, never faked


def test_identical_pending_pods_admitted_in_any_order_give_one_allocation_each(settings, clock):
    """Found by the footprint benchmark: with many identical pending pods, a guess of the
    wrong pod (corrected later by kubelet's record) must never split a container's two
    resources into two allocations or onto two cards."""
    pods = Pods(
        *(
            gpu_pod(f"p{i}", ("main", {MEM_NAME: 1, CORE_NAME: 2}), created=float(i))
            for i in range(12)
        )
    )
    allocator = with_pods(settings, clock, pods)
    record = {}
    for i in reversed(range(12)):  # kubelet admits them newest first
        order = [(MEM, 1), (CORE, 2)] if i % 2 else [(CORE, 2), (MEM, 1)]
        results = admit(allocator, order)
        [allocation_id] = {r.allocation_id for r in results.values()}
        allocation = allocator.allocation(allocation_id)
        record[ContainerRef("ns", f"p{i}", "main")] = {
            MEM_NAME: list(allocation.devices[MEM]),
            CORE_NAME: list(allocation.devices[CORE]),
        }
        if i % 3 == 0:
            allocator.reconcile(record)  # kubelet's record names the real pods meanwhile
    allocator.reconcile(record)
    allocations = allocator.allocations()
    assert len(allocations) == 12
    assert all(len(a.cards) == 1 and a.memory_units == 1 and a.core_percent == 2
               for a in allocations)  # fmt: skip
    assert {a.owner.pod for a in allocations} == {f"p{i}" for i in range(12)}


def test_second_resource_follows_the_first_even_with_an_older_half_admitted_pod(settings, clock):
    """An older pod whose admission stopped after its memory (kubelet keeps those devices)
    looks like a container mid-admission; the next container's share must still join that
    next container's own memory, on its card."""
    half = gpu_pod("half", ("main", {MEM_NAME: 1, CORE_NAME: 2}), created=0.0)
    pinned = gpu_pod(
        "pinned",
        ("main", {MEM_NAME: 1, CORE_NAME: 2}),
        created=1.0,
        annotations={"ALIYUN_COM_GPU_MEM_IDX": "1"},
    )
    allocator = with_pods(settings, clock, Pods(half, pinned))
    admit(allocator, [(MEM, 1)])  # "half": its share request then failed in kubelet
    results = admit(allocator, [(MEM, 1), (CORE, 2)])  # "pinned", on the extender's GPU1
    assert results[MEM].envs["NVIDIA_VISIBLE_DEVICES"] == GPU1
    assert results[CORE].envs["NVIDIA_VISIBLE_DEVICES"] == GPU1
    assert results[MEM].allocation_id == results[CORE].allocation_id
    half_allocation = next(a for a in allocator.allocations() if a.owner.pod == "half")
    assert half_allocation.core_percent == 0  # untouched


def test_card_changes_move_only_when_a_cards_state_changes(allocator):
    """ListAndWatch streams and the MPS supervisor wait on card_changes: it moves when a card
    starts or stops holding shared work, is given out whole or freed, or its health changes,
    and not on an ordinary admission to a card that already holds shared work."""
    cards = allocator.card_changes
    start = cards.generation
    first = admit(allocator, [(MEM, 2)])[MEM]
    assert cards.generation == start + 1  # the card now holds shared work
    listed = allocator.devices(WHOLE)
    before = cards.generation
    admit(allocator, [(MEM, 1)])  # binpack: the same card
    assert cards.generation == before  # nothing a device list shows has changed
    assert allocator.devices(WHOLE) is listed  # and the list is not rebuilt
    allocator.set_card_problem(GPU1, "MPS control daemon not running")
    assert cards.generation == before + 1
    assert first.allocation_id in {a.id for a in allocator.allocations()}


def test_a_card_taking_or_dropping_shared_work_rebuilds_only_the_whole_card_list(allocator, clock):
    """A card that starts or stops holding shared work changes what the whole-card resource
    lists (it cannot be given out whole meanwhile), not what the memory and share lists show:
    those stay the same list objects, so their ListAndWatch streams send nothing and do not
    compare thousands of devices (16 cards: ~17,000 memory IDs) at every such flip."""
    lists = {kind: allocator.devices(kind) for kind in (MEM, CORE, WHOLE)}
    admit(allocator, [(MEM, 2)])  # an empty card now holds shared work
    assert allocator.devices(MEM) is lists[MEM]
    assert allocator.devices(CORE) is lists[CORE]
    whole = allocator.devices(WHOLE)
    assert whole is not lists[WHOLE]
    assert sum(not d.healthy for d in whole) == 1
    clock.now += 100  # past the grace period, and kubelet does not report it: released
    allocator.reconcile({})  # the card is empty again
    assert allocator.devices(MEM) is lists[MEM]
    assert all(d.healthy for d in allocator.devices(WHOLE))
    allocator.set_card_problem(GPU1, "MPS control daemon not running")
    problem = allocator.devices(MEM)  # health changed: rebuilt
    assert problem is not lists[MEM]
    assert {d.healthy for d in problem if d.id.startswith(GPU1)} == {False}


def kubelet_free(allocator, kind, gone):
    """kubelet's free IDs of ``kind``: what the ledger does not hold, and the IDs of the
    allocations of the pods in ``gone`` (kubelet frees a gone pod's devices at once,
    before the daemon reconciles)."""
    freed = [
        device_id
        for a in allocator.allocations()
        if a.owner is not None and a.owner.pod in gone
        for device_id in a.devices.get(kind, ())
    ]
    return free(allocator, kind) + freed


def admit_from(allocator, requests, gone):
    """``admit`` with kubelet's free lists after the pods ``gone`` left."""
    results = {}
    for kind, size in requests:
        ids = allocator.preferred(kind, kubelet_free(allocator, kind, gone), [], size)
        results[kind] = allocator.allocate(kind, ids)
    return results


def running(pod):
    return replace(pod, phase="Running")


@pytest.mark.parametrize("order", [[(MEM, 12), (CORE, 50)], [(CORE, 50), (MEM, 12)]])
def test_a_pod_right_after_a_gone_one_gets_its_room_before_any_reconcile(settings, clock, order):
    """kubelet hands a gone pod's devices to the next pod at once, before the daemon's
    reconcile releases them. The next container's first resource shows the gone pod's
    devices of that kind free in kubelet's list: kubelet frees a pod's devices all at once,
    so its other resource is free too, and the whole demand fits the card it leaves
    (both cards full in the ledger: a refusal here would be final for the pod)."""
    old = [gpu_pod(f"old-{i}", ("main", {MEM_NAME: 12, CORE_NAME: 50})) for i in range(2)]
    pods = Pods(*old)
    allocator = with_pods(settings, clock, pods)
    for pod in old:
        pods.pods = [pod]
        admit(allocator, [(MEM, 12), (CORE, 50)])
    cards = {a.owner.pod: a.cards[0] for a in allocator.allocations()}
    assert set(cards.values()) == {GPU0, GPU1}
    pods.pods, pods.others = (
        [gpu_pod("new", ("main", {MEM_NAME: 12, CORE_NAME: 50}))],
        [running(old[1])],
    )
    results = admit_from(allocator, order, gone={"old-0"})
    assert {r.envs["NVIDIA_VISIBLE_DEVICES"] for r in results.values()} == {cards["old-0"]}
    new = next(a for a in allocator.allocations() if a.owner.pod == "new")
    assert (new.memory_units, new.core_percent) == (12, 50)
    assert "old-0" not in {a.owner.pod for a in allocator.allocations()}  # taken over


@pytest.mark.parametrize("cache", ["deleted", "deleting", "finished", "kept", "not live"])
def test_when_nothing_else_fits_a_deleted_pods_allocation_does_not_block(settings, clock, cache):
    """The gone pod held memory only, and the next container asks memory and share, share
    first: the share list cannot show the gone pod's memory free. When no card fits by the
    ledger, an allocation whose pod the live pod cache shows deleted, being deleted or
    finished does not count; the memory request then meets kubelet's own list. A pod still
    running in the cache, or a cache not live, keeps the refusal (nothing says it is gone)."""
    old = [gpu_pod(f"old-{i}", ("main", {MEM_NAME: 12})) for i in range(2)]
    pods = Pods(*old)
    allocator = with_pods(settings, clock, pods)
    for pod in old:
        pods.pods = [pod]
        admit(allocator, [(MEM, 12)])
    cards = {a.owner.pod: a.cards[0] for a in allocator.allocations()}
    gone = {
        "deleted": [],
        "deleting": [replace(old[0], deleting=True)],
        "finished": [replace(old[0], phase="Succeeded")],
        "kept": [running(old[0])],
        "not live": [],
    }[cache]
    pods.pods = [gpu_pod("new", ("main", {MEM_NAME: 12, CORE_NAME: 50}))]
    pods.others = [running(old[1]), *gone]
    pods.live = cache != "not live"
    order = [(CORE, 50), (MEM, 12)]
    if cache in ("kept", "not live"):
        with pytest.raises(NoFitError, match="no single GPU on node-a has 12 GiB and 50% free"):
            admit_from(allocator, order, gone={"old-0"})
        return
    results = admit_from(allocator, order, gone={"old-0"})
    assert {r.envs["NVIDIA_VISIBLE_DEVICES"] for r in results.values()} == {cards["old-0"]}


def recreated(pod, annotations=None):
    """``pod`` deleted and created again under its name (a StatefulSet's web-0, a Job's
    fixed-name pod): another pod, with a new UID."""
    again = gpu_pod(
        pod.name,
        *((c.name, dict(c.requests)) for c in pod.containers),
        annotations=annotations,
        created=pod.created_at + 100,
    )
    return replace(again, uid=pod.uid + "-again")


def admit_freed(allocator, requests, freed):
    """``admit`` with kubelet's free lists once the allocations ``freed`` (IDs) left: kubelet
    let their pod go, the daemon has not reconciled yet."""
    results = {}
    for kind, size in requests:
        let_go = [
            device_id
            for a in allocator.allocations()
            if a.id in freed
            for device_id in a.devices.get(kind, ())
        ]
        ids = allocator.preferred(kind, free(allocator, kind) + let_go, [], size)
        results[kind] = allocator.allocate(kind, ids)
    return results


@pytest.mark.parametrize("order", [[(MEM, 2), (CORE, 10)], [(CORE, 10), (MEM, 2)]])
def test_a_pod_recreated_under_its_name_before_a_reconcile_is_matched_to_its_spec(
    settings, clock, order
):
    """web-0 deleted and created again (a new UID), and admitted before the daemon
    reconciled the old one's allocation away (it still holds under web-0/main): the new pod
    is matched to its own spec, not admitted without pod identity. So the extender's card
    is honoured, the pod-total env is there, and its allocation records its pod's UID."""
    old = gpu_pod("web-0", ("main", {MEM_NAME: 2, CORE_NAME: 10}))
    pods = Pods(old, live=False)  # not live: a miss is not waited for
    allocator = with_pods(settings, clock, pods)
    admit(allocator, [(MEM, 2), (CORE, 10)])  # binpack: GPU0
    [first] = allocator.allocations()
    assert (first.cards, first.owner_uid) == ((GPU0,), old.uid)
    new = recreated(old, annotations={"ALIYUN_COM_GPU_MEM_IDX": "1"})
    pods.pods = [new]
    clock.now += 1
    results = admit_freed(allocator, order, {first.id})
    assert {r.envs["NVIDIA_VISIBLE_DEVICES"] for r in results.values()} == {GPU1}
    assert results[order[1][0]].envs["ALIYUN_COM_GPU_MEM_POD"] == "2"
    [mine] = [a for a in allocator.allocations() if a.id != first.id]
    assert (mine.owner, mine.owner_uid) == (ContainerRef("ns", "web-0", "main"), new.uid)
    assert (mine.memory_units, mine.core_percent) == (2, 10)
    assert allocator.allocation(first.id) == first  # the old one, until reconcile


def test_a_recreated_pods_old_allocation_does_not_block_its_room(settings, clock):
    """As a deleted pod's allocation, when nothing else fits: the live pod cache shows
    web-0 pending under a new UID, so the allocation made for the old web-0 is no longer
    that pod's and does not count; the new web-0 lands where the old one was."""
    old = [gpu_pod(f"web-{i}", ("main", {MEM_NAME: 12})) for i in range(2)]
    pods = Pods(*old)
    allocator = with_pods(settings, clock, pods)
    for pod in old:
        pods.pods = [pod]
        admit(allocator, [(MEM, 12)])
    cards = {a.owner.pod: a.cards[0] for a in allocator.allocations()}
    web0 = next(a for a in allocator.allocations() if a.owner.pod == "web-0")
    pods.pods = [recreated(gpu_pod("web-0", ("main", {MEM_NAME: 12, CORE_NAME: 50})))]
    pods.others = [running(old[1])]
    results = admit_freed(allocator, [(CORE, 50), (MEM, 12)], {web0.id})
    assert {r.envs["NVIDIA_VISIBLE_DEVICES"] for r in results.values()} == {cards["web-0"]}
    assert allocator.allocation(web0.id) is None  # its memory taken over by kubelet's choice
