"""A stateful property test of the allocation state: the allocator and its ledger driven
through random admissions, releases, reconciles, daemon crashes (also between an
admission's GetPreferredAllocation and its Allocate), clock jumps and kubelet restarts,
against a model of kubelet (which devices it has handed to which container). After every
step the ledger's invariants (nodemgr.domain.invariants) hold; after every reconcile they
hold against kubelet's record too. Bounded to well under 60 s."""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.invariants import CardCapacity, check_invariants
from nodemgr.domain.model import ContainerRef
from nodemgr.errors import ConflictError, NoFitError
from nodemgr.inventory import open_inventory
from tests.harness.cards import GPU0, GPU1, simulated_settings
from tests.harness.clock import Clock

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
        names = self.allocator.resource_names
        return {
            ref: {names[kind]: list(ids) for kind, ids in held.items()}
            for ref, held in self.kubelet.items()
        }

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
        """The periodic compare with kubelet's record; then the ledger agrees with it."""
        self.allocator.reconcile(self._record())
        problems = check_invariants(
            self.allocator.allocations(),
            self.capacities,
            UNIT_MIB,
            kubelet_record={ref: dict(held) for ref, held in self.kubelet.items()},
        )
        assert problems == [], problems

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


AllocationMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocationProperties = AllocationMachine.TestCase
