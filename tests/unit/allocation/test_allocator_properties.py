"""A stateful property test of the allocation state: the allocator and its ledger driven
through random admissions, releases, reconciles, daemon crashes (also between an
admission's GetPreferredAllocation and its Allocate), clock jumps and kubelet restarts,
against a model of kubelet (which devices it has handed to which container). After every
step the ledger's invariants (nodemgr.domain.invariants) hold; after every reconcile they
hold against kubelet's record too, and the reconcile (which judges only what changed since
the last one) changed the state exactly as the full walk over every allocation would have.
Bounded to well under 60 s."""

from __future__ import annotations

import itertools
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nodemgr.allocation.admission import ADMISSION_WINDOW_SECONDS
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.invariants import CardCapacity, check_invariants
from nodemgr.domain.model import Allocation, ContainerRef
from nodemgr.domain.reconcile import ReconcilePlan, plan_reconcile
from nodemgr.errors import ConflictError, NoFitError
from nodemgr.inventory import open_inventory
from standins.cards import GPU0, GPU1, simulated_settings
from standins.clock import Clock

MEM, CORE, WHOLE = ResourceKind.MEMORY, ResourceKind.CORE, ResourceKind.WHOLE
UNIT_MIB = 1024
REQUESTS = st.sampled_from(
    [
        ((MEM, 1),),
        ((MEM, 2), (CORE, 30)),
        ((CORE, 40), (MEM, 1)),
        ((CORE, 50),),
        ((MEM, 3), (CORE, 10)),
        ((WHOLE, 1),),
    ]
)


class AllocationMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="gs-prop-")
        devices = [
            {"uuid": GPU0, "name": "T4", "memory_mib": 4 * UNIT_MIB},
            {"uuid": GPU1, "name": "T4", "memory_mib": 2 * UNIT_MIB},
        ]
        self.settings = simulated_settings(self.dir, devices=devices)
        self.cards = open_inventory(self.settings.gpus).cards()
        self.capacities = [
            CardCapacity(c.uuid, c.index, c.memory_mib // UNIT_MIB) for c in self.cards
        ]
        self.clock = Clock()
        self.ledger: Ledger | None = None
        self.allocator = self._start()
        # kubelet's checkpoint: container -> kind -> device IDs it handed out
        self.kubelet: dict[ContainerRef, dict[ResourceKind, list[str]]] = {}
        self.last_record: dict[ContainerRef, dict[str, list[str]]] = {}
        self.serial = 0

    def _start(self) -> Allocator:
        """The daemon (re)starts: a fresh allocator over the ledger on disk."""
        if self.ledger is not None:
            self.ledger.close()
        self.ledger = Ledger(self.settings.state_dir)
        return Allocator(
            self.settings,
            self.cards,
            self.ledger,
            clock=self.clock,
            monotonic=self.clock,
        )

    def teardown(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _free(self, kind: ResourceKind) -> list[str]:
        """What kubelet would offer: healthy devices it has not handed out."""
        taken = {i for held in self.kubelet.values() for i in held.get(kind, [])}
        return [d.id for d in self.allocator.devices(kind) if d.healthy and d.id not in taken]

    def _record(self) -> dict[ContainerRef, dict[str, list[str]]]:
        """kubelet's PodResources record; the same object while it is unchanged, as the
        daemon's PodResources client hands it back."""
        names = self.allocator.resource_names
        record = {
            ref: {names[kind]: list(ids) for kind, ids in held.items()}
            for ref, held in self.kubelet.items()
        }
        if record != self.last_record:
            self.last_record = record
        return self.last_record

    @rule(request=REQUESTS, crash_at=st.sampled_from([None, 0, 1]))
    def admit(self, request, crash_at):
        """kubelet admits one container: per resource, GetPreferredAllocation then Allocate;
        ``crash_at``: the daemon is killed after that resource's preferred call."""
        self.serial += 1
        ref = ContainerRef("ns", f"pod-{self.serial}", "main")
        for position, (kind, size) in enumerate(request):
            free = self._free(kind)
            if len(free) < size:
                return  # kubelet refuses by itself: not enough devices
            try:
                chosen = self.allocator.preferred(kind, free, [], size)
            except NoFitError:
                return
            assert set(chosen) <= set(free) and len(chosen) == size
            if crash_at == position:
                self.allocator = self._start()
            try:
                self.allocator.allocate(kind, chosen)
            except (NoFitError, ConflictError):
                return  # refused: kubelet records nothing for this resource
            self.kubelet.setdefault(ref, {})[kind] = list(chosen)

    @precondition(lambda self: self.kubelet)
    @rule(data=st.data())
    def release(self, data):
        """A pod goes away: kubelet forgets its devices."""
        ref = data.draw(st.sampled_from(sorted(self.kubelet)))
        del self.kubelet[ref]

    @rule()
    def reconcile(self):
        """The periodic compare with kubelet's record: the state after it is the state the
        full walk's plan makes of the state before; then the ledger agrees with kubelet."""
        before = self.allocator.allocations()
        reported = {
            (kind, device_id): ref
            for ref, held in self.kubelet.items()
            for kind, ids in held.items()
            for device_id in ids
        }
        counter = itertools.count()
        oracle = plan_reconcile(
            before,
            reported,
            self.clock(),
            self.settings.kubelet.allocation_grace_seconds,
            UNIT_MIB,
            lambda: f"ga-oracle-{next(counter)}",
        )
        self.allocator.reconcile(self._record())
        after = self.allocator.allocations()
        assert canonical(after, before) == canonical(applied(before, oracle), before)
        problems = check_invariants(
            self.allocator.allocations(),
            self.capacities,
            UNIT_MIB,
            kubelet_record={ref: dict(held) for ref, held in self.kubelet.items()},
        )
        assert problems == [], problems

    @rule(request=REQUESTS)
    def admit_and_reconcile(self, request):
        """A container admitted (no crash), then the periodic reconcile: what it judges is
        what that admission changed."""
        self.admit(request, None)
        self.reconcile()

    @rule(request=REQUESTS.filter(lambda request: len(request) == 2))
    def slow_admission(self, request):
        """A container's second resource comes after the admission window, its first one
        already confirmed and settled: a second allocation, which the next reconcile merges
        into the first (not judged itself: it changed nothing since)."""
        self.serial += 1
        ref = ContainerRef("ns", f"pod-{self.serial}", "main")
        for position, (kind, size) in enumerate(request):
            free = self._free(kind)
            if len(free) < size:
                return
            try:
                chosen = self.allocator.preferred(kind, free, [], size)
                self.allocator.allocate(kind, chosen)
            except (NoFitError, ConflictError):
                return
            self.kubelet.setdefault(ref, {})[kind] = list(chosen)
            if position == 0:
                self.reconcile()
                self.reconcile()
                self.clock.now += ADMISSION_WINDOW_SECONDS + 1
        self.reconcile()

    @precondition(lambda self: self.kubelet)
    @rule(data=st.data())
    def release_and_reconcile(self, data):
        """A pod goes away, then the periodic reconcile: what it judges is that pod's devices."""
        self.release(data)
        self.reconcile()

    @rule(request=REQUESTS)
    def never_reported(self, request):
        """kubelet fails the pod after its Allocate calls (another resource refused, the pod
        deleted meanwhile): its devices go back to kubelet's pool and its record never shows
        them; then the periodic reconcile, which keeps them until their grace ends."""
        for kind, size in request:
            free = self._free(kind)
            if len(free) < size:
                return
            try:
                self.allocator.allocate(kind, self.allocator.preferred(kind, free, [], size))
            except (NoFitError, ConflictError):
                return
        self.reconcile()

    @rule(seconds=st.sampled_from([30.0, 61.0]))
    def time_passes_and_reconcile(self, seconds):
        """The clock moves on, then the periodic reconcile: the allocations whose grace ended
        while they waited are judged (released)."""
        self.time_passes(seconds)
        self.reconcile()

    @rule()
    def crash(self):
        """kill -9 of the daemon and a restart: the ledger on disk is all that is left."""
        before = self.allocator.allocations()
        self.allocator = self._start()
        assert self.allocator.allocations() == before

    @rule(seconds=st.sampled_from([1.0, 30.0, 120.0]))
    def time_passes(self, seconds):
        self.clock.now += seconds

    @invariant()
    def ledger_invariants_hold(self):
        problems = check_invariants(self.allocator.allocations(), self.capacities, UNIT_MIB)
        assert problems == [], problems


def applied(before: list[Allocation], plan: ReconcilePlan) -> list[Allocation]:
    """The allocations after ``plan``, as the ledger commits it (an update keeps its
    first created_at)."""
    state = {a.id: a for a in before}
    for allocation_id in plan.delete:
        state.pop(allocation_id, None)
    for allocation in plan.put:
        old = state.get(allocation.id)
        if old is not None:
            allocation = Allocation(
                allocation.id,
                allocation.devices,
                allocation.memory_mib,
                old.created_at,
                allocation.owner,
                allocation.confirmed_at,
            )
        state[allocation.id] = allocation
    return list(state.values())


def canonical(allocations: list[Allocation], before: list[Allocation]) -> dict:
    """The allocations keyed by ID where the ID was live before, else by their devices
    (a new allocation's ID is random; no two allocations share a device)."""
    old_ids = {a.id for a in before}
    return {
        (a.id if a.id in old_ids else frozenset(a.device_pairs())): (
            a.devices,
            a.memory_mib,
            a.created_at,
            a.owner,
            a.confirmed_at,
        )
        for a in allocations
    }


AllocationMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocationProperties = AllocationMachine.TestCase
