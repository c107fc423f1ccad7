"""Pins nodemgr.enforcement.registry.ContainerRegistry, the hook's decisions without the
socket: a container asking for no GPU passes unregistered, as does one that holds an
allocation but asks for no GPU; a container whose env matches a live allocation is
registered durably and a restarted daemon knows it; a released or unknown allocation, a
bad cgroup or a vanished init process is refused with one line naming the container;
only one pod identity ever holds an allocation, also under concurrent admissions; a
ledger that cannot record refuses the container; ``release`` and ``prune`` forget
containers (pruning those whose init process is gone or whose PID was reused). Only a
container cgroup is registered (a host cgroup such as the runtime's own service is refused).
With kubelet's record to ask, an allocation kubelet no longer reports (its pod is gone) is
refused at once, and so is every GPU container while kubelet cannot be asked, or while the
watchdog cannot judge the node's GPU processes (fail closed).
An allocation is its pod's: a GPU container without a pod identity is refused, one of another
pod than the one kubelet's record shows holding it is refused, any container of that pod
(init containers and sidecars too) is admitted, and one two pods hold parts of is refused."""

import dataclasses
import subprocess
import sys
import threading

import pytest

from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.domain.deviceids import ResourceKind, card_device_ids
from nodemgr.domain.model import Allocation, CgroupKey, ContainerRef
from nodemgr.enforcement.registry import ContainerRegistry
from nodemgr.errors import LedgerError
from nodemgr.inventory import open_inventory
from nodemgr.kubelet.registration import KubeletUnavailable
from standins.cards import MPS_PIPE, env_of, simulated_settings

MEM, CORE = ResourceKind.MEMORY, ResourceKind.CORE
CGROUP = "0::/kubepods/pod-a/c1\n"
POD_A = ContainerRef("default", "a", "main")
POD_B = ContainerRef("default", "b", "main")


class Node:
    def __init__(self, tmp_path):
        self.settings = simulated_settings(str(tmp_path))
        self.ledger = Ledger(self.settings.state_dir)
        cards = open_inventory(self.settings.gpus).cards()
        self.allocator = Allocator(self.settings, cards, self.ledger, clock=lambda: 1000.0)
        self.registry = self.new_registry()

    def new_registry(self):
        return ContainerRegistry(self.ledger, self.allocator, MPS_PIPE, clock=lambda: 2000.0)

    def allocate(self, memory_units=4, core_percent=30):
        """What kubelet does for one container: both resources, on one card."""
        allocation_id = None
        for kind, size in ((MEM, memory_units), (CORE, core_percent)):
            held = {key for a in self.allocator.allocations() for key in a.device_pairs()}
            available = [d.id for d in self.allocator.devices(kind) if (kind, d.id) not in held]
            ids = self.allocator.preferred(kind, available, [], size)
            allocation_id = self.allocator.allocate(kind, ids).allocation_id
        return self.allocator.allocation(allocation_id)

    def stored(self):
        return {r.container_id: r for r in Ledger(self.settings.state_dir).load_registrations()}


@pytest.fixture
def node(tmp_path):
    node = Node(tmp_path)
    yield node
    node.ledger.close()


def start_child():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.fixture
def child():
    process = start_child()
    yield process
    process.kill()
    process.wait()


def gone_pid():
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1


def test_a_container_asking_for_no_gpu_passes_unregistered(node, child):
    """No GPU asked and no allocation claimed: allowed, nothing recorded."""
    allowed, message = node.registry.admit(
        "c1", child.pid, {"NVIDIA_VISIBLE_DEVICES": "void"}, POD_A, CGROUP
    )
    assert (allowed, message) == (True, "container c1 (default/a/main) asks for no GPU")
    assert node.registry.registrations() == [] and node.stored() == {}


def test_a_container_holding_an_allocation_but_asking_for_no_gpu_passes(node, child):
    """The allocation ID with NVIDIA_VISIBLE_DEVICES=void (e.g. a sidecar of the pod):
    allowed, not registered (it can start no GPU process)."""
    allocation = node.allocate()
    env = env_of(allocation, NVIDIA_VISIBLE_DEVICES="void")
    allowed, message = node.registry.admit("c1", child.pid, env, None, CGROUP)
    assert allowed is True
    assert message == f"container c1 holds allocation {allocation.id} but asks for no GPU"
    assert node.registry.registrations() == []


def test_a_matching_container_is_registered_durably(node, child):
    """A matching env: allowed, registered with its cgroup, init PID and start time,
    identity and the registry's clock; a registry made on the same ledger (a daemon
    restart) knows it."""
    allocation = node.allocate()
    allowed, message = node.registry.admit("c1", child.pid, env_of(allocation), POD_A, CGROUP)
    assert allowed is True
    assert message == f"container c1 (default/a/main) registered on allocation {allocation.id}"
    [registration] = node.registry.registrations()
    assert registration.allocation_id == allocation.id
    assert registration.cgroup == CgroupKey("", "/kubepods/pod-a/c1")
    assert registration.init_pid == child.pid and registration.init_start_ticks > 0
    assert (registration.identity, registration.registered_at) == (POD_A, 2000.0)
    assert node.stored() == {"c1": registration}
    assert node.new_registry().registrations() == [registration]


def test_an_unknown_allocation_is_refused(node, child):
    """An allocation ID the daemon does not hold (released, or made up): refused with
    one line naming the container."""
    allocation = node.allocate()
    released = dataclasses.replace(allocation, id="ga-released")
    allowed, message = node.registry.admit("c1", child.pid, env_of(released), POD_A, CGROUP)
    assert allowed is False
    assert message.startswith("gpushare-node refused container c1 (default/a/main): ")
    assert "\n" not in message
    assert node.registry.registrations() == [] and node.stored() == {}


def test_a_container_without_its_own_cgroup_is_refused(node, child):
    """The container must have a cgroup of its own (the watchdog tells pods apart by it)."""
    allocation = node.allocate()
    allowed, message = node.registry.admit("c1", child.pid, env_of(allocation), POD_A, "0::/\n")
    assert allowed is False and message.startswith("gpushare-node refused container c1")
    assert node.registry.registrations() == []


def test_a_vanished_init_process_is_refused(node):
    """The init process is gone before the hook's call lands: refused, naming the PID."""
    allocation = node.allocate()
    pid = gone_pid()
    allowed, message = node.registry.admit("c1", pid, env_of(allocation), POD_A, CGROUP)
    assert allowed is False
    assert message.endswith(f"its init process {pid} is gone")


def test_one_identity_per_allocation_also_when_admissions_race(node, child):
    """Containers of several pods claiming one allocation at the same moment: exactly one
    pod's containers are let in."""
    allocation = node.allocate()
    env = env_of(allocation)
    barrier = threading.Barrier(8)
    results = {}

    def admit(i):
        identity = ContainerRef("default", f"pod-{i % 4}", "main")
        barrier.wait(5)
        cgroup = f"0::/kubepods/pod-a/c{i}\n"
        results[i] = (identity, node.registry.admit(f"c{i}", child.pid, env, identity, cgroup))

    threads = [threading.Thread(target=admit, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    allowed = {identity for identity, (ok, _) in results.values() if ok}
    assert len(results) == 8
    assert len(allowed) == 1
    assert {r.identity for r in node.registry.registrations()} == allowed


def test_a_ledger_that_cannot_record_refuses_the_container(node, child, monkeypatch):
    """Registration that cannot be made durable: refused (the watchdog could not tell
    whose process it is after a restart), and nothing kept in memory either."""
    allocation = node.allocate()

    def broken(registration):
        raise LedgerError("cannot write the ledger /state/ledger.db: disk I/O error")

    monkeypatch.setattr(node.ledger, "put_registration", broken)
    allowed, message = node.registry.admit("c1", child.pid, env_of(allocation), POD_A, CGROUP)
    assert allowed is False
    assert message == (
        "gpushare-node refused container c1 (default/a/main): cannot record it "
        "(cannot write the ledger /state/ledger.db: disk I/O error)"
    )
    assert node.registry.registrations() == []


def test_release_forgets_a_container_once(node, child):
    """release: True and the ledger row gone; again (or an unknown ID): False."""
    allocation = node.allocate()
    assert node.registry.admit("c1", child.pid, env_of(allocation), POD_A, CGROUP)[0]
    assert node.registry.release("c1") is True
    assert node.registry.registrations() == [] and node.stored() == {}
    assert node.registry.release("c1") is False
    assert node.registry.release("never-seen") is False


def test_release_forgets_in_memory_even_if_the_ledger_fails(node, child, monkeypatch):
    """A ledger error on release is logged; the container is forgotten all the same."""
    allocation = node.allocate()
    assert node.registry.admit("c1", child.pid, env_of(allocation), POD_A, CGROUP)[0]

    def broken(container_id):
        raise LedgerError("disk full")

    monkeypatch.setattr(node.ledger, "delete_registration", broken)
    assert node.registry.release("c1") is True
    assert node.registry.registrations() == []


def test_prune_drops_containers_whose_init_process_is_gone(node, child):
    """No poststop came for a container whose init process exited: prune forgets it and
    keeps the running one."""
    allocation = node.allocate()
    doomed = start_child()
    try:
        live_cgroup = "0::/kubepods/pod-a/live\n"
        assert node.registry.admit("live", child.pid, env_of(allocation), POD_A, live_cgroup)[0]
        dead_cgroup = "0::/kubepods/pod-a/dead\n"
        assert node.registry.admit("dead", doomed.pid, env_of(allocation), POD_A, dead_cgroup)[0]
    finally:
        doomed.kill()
        doomed.wait()
    node.registry.prune()
    assert [r.container_id for r in node.registry.registrations()] == ["live"]
    assert set(node.stored()) == {"live"}


def test_prune_drops_a_running_container_whose_allocation_is_gone(node, child):
    """A container taken back from its cgroup mark into a ledger made at start, while
    kubelet could not be read, is registered on an allocation ID the first reconcile is
    to adopt. Prune keeps it while that adoption is pending, and forgets it once the
    reconcile has run without kubelet giving the allocation back: a registration of no
    allocation breaks the ledger's invariants (check-ledger, doctor), and the watchdog
    judges the container's processes the same without it (unallocated)."""
    allocation = node.allocate()
    assert node.registry.admit("c1", child.pid, env_of(allocation), POD_A, CGROUP)[0]
    [registration] = node.registry.registrations()
    orphan = dataclasses.replace(registration, container_id="c2", allocation_id="ga-recovered")
    node.ledger.put_registration(orphan)
    node.allocator.keep_id_hints({POD_A: "ga-recovered"})
    restarted = node.new_registry()
    restarted.prune()
    assert {r.container_id for r in restarted.registrations()} == {"c1", "c2"}
    node.allocator.reconcile({POD_A: {"aliyun.com/gpu-mem": list(allocation.devices[MEM])}})
    restarted.prune()
    assert [r.container_id for r in restarted.registrations()] == ["c1"]
    assert set(node.stored()) == {"c1"}


def test_prune_drops_a_container_whose_pid_was_reused(node, child):
    """A registration whose PID now belongs to another process (other start time) is
    stale: pruned, though a process with that PID runs."""
    allocation = node.allocate()
    assert node.registry.admit("c1", child.pid, env_of(allocation), POD_A, CGROUP)[0]
    [registration] = node.registry.registrations()
    node.ledger.put_registration(
        dataclasses.replace(registration, init_start_ticks=registration.init_start_ticks - 1)
    )
    restarted = node.new_registry()
    restarted.prune()
    assert restarted.registrations() == []


# --- only container cgroups (issue 14, item 10) --------------------------------------------


@pytest.mark.parametrize(
    "cgroup",
    [
        "0::/system.slice/containerd.service\n",
        "0::/kubepods/pod-a\n",  # the pod's cgroup: every container of the pod
        "0::/kubepods/pod-a/another-container\n",
        "12:memory:/user.slice\n0::/\n",
    ],
)
def test_a_host_cgroup_is_refused(node, child, cgroup):
    """A cgroup that is not this container's own (the runtime's service, the pod, another
    container): refused, naming it; registering it would make every process in it (the
    runtime itself) count as this container's."""
    allocation = node.allocate()
    allowed, message = node.registry.admit("c1", child.pid, env_of(allocation), POD_A, cgroup)
    assert allowed is False
    assert message.startswith("gpushare-node refused container c1 (default/a/main): ")
    assert "not a container cgroup" in message
    assert node.registry.registrations() == [] and node.stored() == {}


# --- kubelet's record at the moment of the hook call (issue 14, item 6) --------------------


class FakeKubelet:
    """kubelet's PodResources List as the registry is given it: a callable."""

    def __init__(self):
        self.record = {}
        self.calls = 0
        self.down = False

    def list(self):
        self.calls += 1
        if self.down:
            raise KubeletUnavailable("kubelet PodResources API at /x.sock did not answer")
        return self.record

    def report(self, node, allocation, ref):
        names = node.allocator.resource_names
        self.record[ref] = {names[kind]: list(ids) for kind, ids in allocation.devices.items()}


@pytest.fixture
def kubelet():
    return FakeKubelet()


@pytest.fixture
def asking(node, kubelet):
    node.registry = ContainerRegistry(
        node.ledger, node.allocator, MPS_PIPE, clock=lambda: 2000.0, kubelet_record=kubelet.list
    )
    return node


def test_an_allocation_kubelet_still_reports_is_admitted(asking, kubelet, child):
    allocation = asking.allocate()
    kubelet.report(asking, allocation, POD_A)
    allowed, message = asking.registry.admit("c1", child.pid, env_of(allocation), POD_A, CGROUP)
    assert allowed is True, message
    assert kubelet.calls == 1


def test_an_allocation_whose_pod_is_gone_is_refused_before_any_reconcile(asking, kubelet, child):
    """The pod was deleted (kubelet no longer reports its devices) but no reconcile ran yet:
    the allocation is still in the ledger, its id must grant nothing all the same; a
    reconcile is asked for so that it is released at once."""
    allocation = asking.allocate()
    kubelet.report(asking, allocation, POD_A)
    assert asking.registry.admit("c1", child.pid, env_of(allocation), POD_A, CGROUP)[0]
    kubelet.record.clear()  # the pod is gone
    asking.allocator.reconcile_requested.clear()
    cgroup = "0::/kubepods/pod-a/c2\n"
    allowed, message = asking.registry.admit("c2", child.pid, env_of(allocation), POD_A, cgroup)
    assert allowed is False
    assert message.startswith("gpushare-node refused container c2 (default/a/main): ")
    assert f"kubelet no longer reports allocation {allocation.id}" in message
    assert asking.allocator.allocation(allocation.id) is not None  # not yet reconciled
    assert asking.allocator.reconcile_requested.is_set()
    assert [r.container_id for r in asking.registry.registrations()] == ["c1"]


def test_an_allocation_kubelet_never_reported_is_refused(asking, kubelet, child):
    """Allocated, but the pod was refused or deleted before kubelet recorded it."""
    allocation = asking.allocate()
    allowed, message = asking.registry.admit("c1", child.pid, env_of(allocation), POD_A, CGROUP)
    assert allowed is False and "kubelet no longer reports" in message


def test_gpu_containers_are_refused_while_kubelet_cannot_be_asked(asking, kubelet, child):
    """Fail closed: kubelet creates every pod's containers, so while it cannot answer no pod
    container is being made anyway; what asks then is refused, naming kubelet."""
    allocation = asking.allocate()
    kubelet.report(asking, allocation, POD_A)
    kubelet.down = True
    allowed, message = asking.registry.admit("c1", child.pid, env_of(allocation), POD_A, CGROUP)
    assert allowed is False
    assert "cannot ask kubelet whether allocation" in message and "did not answer" in message
    assert asking.registry.registrations() == []


def test_containers_asking_for_no_gpu_do_not_ask_kubelet(asking, kubelet, child):
    allowed, _ = asking.registry.admit(
        "c1", child.pid, {"NVIDIA_VISIBLE_DEVICES": "void"}, POD_A, CGROUP
    )
    assert allowed is True and kubelet.calls == 0


# --- an allocation is its pod's (issue 14, item 4) -----------------------------------------


def test_a_gpu_container_without_a_pod_identity_is_refused(node, child):
    """No CRI annotations (a container made straight with runc): it cannot be tied to the
    pod the allocation was given to, so its allocation id grants nothing, also without a
    kubelet to ask."""
    allocation = node.allocate()
    allowed, message = node.registry.admit("c1", child.pid, env_of(allocation), None, CGROUP)
    assert allowed is False
    assert message.startswith("gpushare-node refused container c1: ")
    assert "the runtime gave no pod identity" in message
    assert node.registry.registrations() == [] and node.stored() == {}


def test_without_a_pod_identity_kubelet_is_not_even_asked(asking, kubelet, child):
    """Refused before the RPC: there is no pod to look up."""
    allocation = asking.allocate()
    kubelet.report(asking, allocation, POD_A)
    allowed, message = asking.registry.admit("c1", child.pid, env_of(allocation), None, CGROUP)
    assert allowed is False and "the runtime gave no pod identity" in message
    assert kubelet.calls == 0


def test_a_container_of_another_pod_is_refused_before_any_owner_is_known(asking, kubelet, child):
    """kubelet gives the allocation to default/a; no reconcile has filled in its owner and no
    container of default/a registered yet: a container of default/b carrying its env is
    still refused, from kubelet's record, naming both pods; no reconcile is asked for."""
    allocation = asking.allocate()
    assert allocation.owner is None
    kubelet.report(asking, allocation, POD_A)
    asking.allocator.reconcile_requested.clear()
    allowed, message = asking.registry.admit("c1", child.pid, env_of(allocation), POD_B, CGROUP)
    assert allowed is False
    assert f"kubelet gives allocation {allocation.id}" in message
    assert "to pod default/a, not to pod default/b" in message
    assert asking.registry.registrations() == []
    assert not asking.allocator.reconcile_requested.is_set()


@pytest.mark.parametrize("container", ["init-weights", "sidecar"])
def test_every_container_of_the_holding_pod_is_admitted(asking, kubelet, child, container):
    """kubelet lists default/a's app container; an init container (never listed: kubelet
    hands its devices on) or a sidecar of default/a uses the same allocation, next to it."""
    allocation = asking.allocate()
    kubelet.report(asking, allocation, POD_A)
    assert asking.registry.admit("c1", child.pid, env_of(allocation), POD_A, CGROUP)[0]
    other = ContainerRef("default", "a", container)
    cgroup = "0::/kubepods/pod-a/c2\n"
    allowed, message = asking.registry.admit("c2", child.pid, env_of(allocation), other, cgroup)
    assert allowed is True, message
    assert {r.identity for r in asking.registry.registrations()} == {POD_A, other}


def test_an_allocation_two_pods_hold_parts_of_is_refused_and_reconciled(asking, kubelet, child):
    """kubelet reports the allocation's memory for default/a and its share for default/b:
    nobody is tied to it until the reconcile (asked for now) splits it."""
    allocation = asking.allocate()
    names = asking.allocator.resource_names
    kubelet.record[POD_A] = {names[MEM]: list(allocation.devices[MEM])}
    kubelet.record[POD_B] = {names[CORE]: list(allocation.devices[CORE])}
    asking.allocator.reconcile_requested.clear()
    allowed, message = asking.registry.admit("c1", child.pid, env_of(allocation), POD_A, CGROUP)
    assert allowed is False and "several pods (default/a, default/b)" in message
    assert asking.allocator.reconcile_requested.is_set()


# --- an env whose allocation ID went stale (issue 15, items 2 and 5) ------------------------


def test_an_env_naming_a_lost_id_is_judged_against_its_pods_allocation(asking, kubelet, child):
    """The ledger was rebuilt from kubelet's record after its loss: the pod's devices now
    sit in an allocation with a new ID, while kubelet replays the env it cached (old ID).
    The container is registered on its pod's allocation instead of being refused forever."""
    allocation = asking.allocate()
    kubelet.report(asking, allocation, POD_A)
    env = env_of(allocation, GPUSHARE_ALLOCATION_ID="ga-lostlostlostlost")
    allowed, message = asking.registry.admit("c1", child.pid, env, POD_A, CGROUP)
    assert allowed is True, message
    assert [r.allocation_id for r in asking.registry.registrations()] == [allocation.id]


def test_a_split_off_pod_is_admitted_on_its_own_allocation(asking, kubelet, child):
    """Two pods linked by mistake (no API server) were split by reconcile: the second pod's
    env keeps the first one's ID, and it is admitted on the allocation kubelet gives it,
    with its quota env judged against that one; the first pod keeps its own."""
    first = asking.allocate(core_percent=10)
    second = asking.allocate(memory_units=2, core_percent=20)
    kubelet.report(asking, first, POD_A)
    kubelet.report(asking, second, POD_B)
    env = env_of(second, GPUSHARE_ALLOCATION_ID=first.id)
    cgroup = "0::/kubepods/pod-b/c2\n"
    allowed, message = asking.registry.admit("c2", child.pid, env, POD_B, cgroup)
    assert allowed is True, message
    assert [r.allocation_id for r in asking.registry.registrations()] == [second.id]


def test_a_stale_id_gives_nothing_to_a_pod_kubelet_gives_no_allocation(asking, kubelet, child):
    """Another pod's ID in the env of a pod that holds nothing on the card is refused, as
    before: the search goes only through kubelet's record of the container's own pod."""
    allocation = asking.allocate()
    kubelet.report(asking, allocation, POD_A)
    cgroup = "0::/kubepods/pod-b/c3\n"
    allowed, message = asking.registry.admit("c3", child.pid, env_of(allocation), POD_B, cgroup)
    assert allowed is False and "not to pod default/b" in message


class NarrowState:
    """Only what the registry may ask of the allocation state: the cards, the resource
    names, one allocation or all of them, and a reconcile requested."""

    def __init__(self, cards, allocations):
        self.cards = cards
        self.resource_names = {MEM: "aliyun.com/gpu-mem", CORE: "aliyun.com/gpu-core.percentage"}
        self._allocations = {a.id: a for a in allocations}
        self.reconciles_requested = 0

    def allocation(self, allocation_id):
        return self._allocations.get(allocation_id)

    def allocations(self):
        return list(self._allocations.values())

    def request_reconcile(self):
        self.reconciles_requested += 1


def test_the_registry_asks_the_allocation_state_only_through_its_narrow_view(tmp_path, child):
    """Over an object with the registry's view of the allocation state alone (no Allocator):
    a container of an allocation kubelet no longer reports is refused and a reconcile is
    requested through the view."""
    settings = simulated_settings(str(tmp_path))
    ledger = Ledger(settings.state_dir)
    try:
        cards = open_inventory(settings.gpus).cards()
        gpu = cards[0].uuid
        allocation = Allocation(
            "ga-narrow",
            {
                MEM: tuple(card_device_ids(MEM, gpu, 4)),
                CORE: tuple(card_device_ids(CORE, gpu, 30)),
            },
            4096,
            1000.0,
        )
        state = NarrowState(cards, [allocation])
        registry = ContainerRegistry(ledger, state, MPS_PIPE, kubelet_record=dict)
        allowed, message = registry.admit("c1", child.pid, env_of(allocation), POD_A, CGROUP)
        assert allowed is False and "kubelet no longer reports allocation ga-narrow" in message
        assert state.reconciles_requested == 1
    finally:
        ledger.close()


def test_gpu_containers_are_refused_while_enforcement_cannot_judge(node, child):
    """While the watchdog cannot judge the node's GPU processes, a GPU container that would
    otherwise be admitted is refused, naming why (it would run unpoliced), and nothing is
    registered; a container asking for no GPU still passes; once the watchdog judges
    again the GPU container is admitted."""
    allocation = node.allocate()
    why = "enforcement cannot judge: cannot read /proc: Too many open files"
    problem: list[str | None] = [why]
    node.registry.enforcement_problem = lambda: problem[0]
    allowed, message = node.registry.admit("c1", child.pid, env_of(allocation), POD_A, CGROUP)
    assert allowed is False
    assert message.startswith(f"gpushare-node refused container c1 (default/a/main): {why}; ")
    assert "unpoliced" in message and node.registry.registrations() == []
    no_gpu = {"NVIDIA_VISIBLE_DEVICES": "void"}
    assert node.registry.admit("c2", child.pid, no_gpu, POD_A, CGROUP)[0] is True
    problem[0] = None
    assert node.registry.admit("c1", child.pid, env_of(allocation), POD_A, CGROUP)[0] is True


def test_a_container_of_a_pod_recreated_under_its_name_is_refused_the_old_ones(tmp_path, child):
    """web-0 deleted and created again: its allocation (its UID, from the pod cache) and the
    old web-0's (the old UID, not released yet) both under default/web-0/main, and a
    record read while kubelet still reported the old one. A container of the new pod (its
    runtime's UID) carrying the old pod's ID is refused naming both UIDs, and one whose env
    ID went stale is judged against its own pod's allocation, never the old pod's."""
    settings = simulated_settings(str(tmp_path))
    ledger = Ledger(settings.state_dir)
    try:
        cards = open_inventory(settings.gpus).cards()
        gpu = cards[0].uuid
        web = ContainerRef("default", "web-0", "main")
        memory = card_device_ids(MEM, gpu, 6)
        old = Allocation("ga-old", {MEM: tuple(memory[:2])}, 2048, 1000.0, owner=web,
                         owner_uid="uid-old")  # fmt: skip
        new = Allocation("ga-new", {MEM: tuple(memory[2:6])}, 4096, 1001.0, owner=web,
                         owner_uid="uid-new")  # fmt: skip
        ledger.commit(put=[old, new])
        state = NarrowState(cards, [old, new])
        record = {web: {state.resource_names[MEM]: list(memory)}}
        registry = ContainerRegistry(ledger, state, MPS_PIPE, kubelet_record=lambda: record)

        def cgroup(container_id):
            return f"0::/kubepods/pod-web/{container_id}\n"

        allowed, message = registry.admit(
            "c1", child.pid, env_of(old), web, cgroup("c1"), pod_uid="uid-new"
        )
        assert allowed is False
        assert "allocation ga-old" in message and "uid-old" in message and "uid-new" in message
        stale = env_of(new, GPUSHARE_ALLOCATION_ID="ga-lostlostlostlost")
        allowed, message = registry.admit(
            "c2", child.pid, stale, web, cgroup("c2"), pod_uid="uid-new"
        )
        assert allowed is True, message
        assert [r.allocation_id for r in registry.registrations()] == ["ga-new"]
        allowed, message = registry.admit(
            "c3", child.pid, env_of(old), web, cgroup("c3"), pod_uid="uid-old"
        )
        assert allowed is True, message  # the old pod's own container, while it lives
    finally:
        ledger.close()
