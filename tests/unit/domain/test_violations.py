"""Pins nodemgr.domain.violations.find_violations: an allocation's GPU memory is the sum over all
the processes of every container registered on it (nested cgroups included; issue 14, item 4)
and only what exceeds quota + grace is a violation, whose pids are the newest processes across
the allocation, just enough to get back within quota + grace, naming the allocation and its pod;
allocation_used_mib sums exactly that for the status; a process without
or above its quota env is an ENV violation; GPU processes on any of the node's cards, shared or
given out whole, outside a live allocation holding that card are UNALLOCATED; whole allocations
get no memory or env checks;
violation keys stay the same across scans; a quota value not in its exact ASCII form is an ENV
violation, and unreadable /proc files fail closed (no environ: ENV; no cgroup: UNALLOCATED).
A process holding its card's MPS control daemon is an MPS_CONTROL violation: acted on when in a
container (registered, or in a mount namespace of its own outside any systemd service), only
named when it is the host's."""

import pytest

from nodemgr.domain.deviceids import ResourceKind, core_device_id, memory_device_id
from nodemgr.domain.model import Allocation, CgroupKey, ContainerRef, Registration
from nodemgr.domain.violations import (
    ENV,
    MEMORY,
    MPS_CONTROL,
    UNALLOCATED,
    ControlHold,
    GpuProcess,
    HolderProcess,
    allocation_used_mib,
    control_hold_violation,
    find_violations,
    index_registrations,
)
from standins.cards import GPU0, GPU1

MEM, CORE, WHOLE = ResourceKind.MEMORY, ResourceKind.CORE, ResourceKind.WHOLE
POD_A = ContainerRef("default", "a", "main")
QUOTA_ENV = {
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
}
GRACE = 128


def shared(id_="ga-1", card=GPU0, units=4, percent=30, owner=None):
    devices = {MEM: tuple(memory_device_id(card, j) for j in range(units))}
    if percent:
        devices[CORE] = tuple(core_device_id(card, j) for j in range(percent))
    return Allocation(id_, devices, units * 1024, 100.0, owner)


def whole(id_="ga-w", card=GPU1):
    return Allocation(id_, {WHOLE: (card,)}, 0, 100.0)


def registration(container_id="c1", allocation_id="ga-1", path="/pod-a/c1", identity=POD_A):
    return Registration(container_id, allocation_id, CgroupKey("", path), 10, 1000, identity, 1.0)


def proc(pid, used_mib, start_ticks=None, card=GPU0, path="/pod-a/c1", env=QUOTA_ENV):
    start = pid * 10 if start_ticks is None else start_ticks
    return GpuProcess(pid, card, used_mib, start, {"": path}, dict(env))


def find(registrations, allocations, processes, whole_cards=(), grace=GRACE):
    """The violations on a node of two cards, ``whole_cards`` given out whole."""
    allocated = {a.id: a for a in allocations}
    return find_violations(
        registrations, allocated, processes, {GPU0, GPU1}, grace, set(whole_cards)
    )


# --- memory ----------------------------------------------------------------------------------


def test_within_quota_is_no_violation():
    assert find([registration()], [shared()], [proc(101, 2000), proc(102, 2000)]) == []


def test_memory_is_summed_over_the_container_processes():
    # Each alone is under the 4096 MiB quota; together 6000 MiB are over it.
    processes = [proc(101, 2000, 500), proc(102, 2000, 700), proc(103, 2000, 600)]
    [violation] = find([registration()], [shared()], processes)
    assert violation.kind == MEMORY
    assert (violation.used_mib, violation.quota_mib) == (6000, 4096)
    assert (violation.container_id, violation.allocation_id) == ("c1", "ga-1")
    assert violation.card_uuid == GPU0 and violation.owner == POD_A
    # Newest first (highest start_ticks, not highest pid): stopping 102 alone leaves 4000.
    assert violation.pids == (102,)
    assert "6000 MiB" in violation.detail and "4096 MiB" in violation.detail


def test_only_as_many_newest_processes_as_needed_are_named():
    processes = [proc(101, 3000, 100), proc(102, 1000, 300), proc(103, 1000, 200)]
    # 5000 used, 4224 allowed: killing 102 (newest) leaves 4000, enough.
    [violation] = find([registration()], [shared()], processes)
    assert violation.pids == (102,)
    processes = [
        proc(101, 1000, 100),
        proc(102, 600, 300),
        proc(103, 600, 200),
        proc(104, 3000, 50),
    ]
    # 5200 used: 102 then 103 are needed to reach 4000 <= 4224.
    [violation] = find([registration()], [shared()], processes)
    assert violation.pids == (102, 103)


def test_grace_is_respected():
    at_limit = [proc(101, 4096 + GRACE)]
    assert find([registration()], [shared()], at_limit) == []
    [violation] = find([registration()], [shared()], [proc(101, 4096 + GRACE + 1)])
    assert violation.kind == MEMORY and violation.pids == (101,)
    assert find([registration()], [shared()], [proc(101, 4097)], grace=0)[0].kind == MEMORY


def test_a_process_in_a_nested_cgroup_counts_as_the_container():
    processes = [proc(101, 3000, 100), proc(102, 3000, 200, path="/pod-a/c1/sub/deeper")]
    [violation] = find([registration()], [shared()], processes)
    assert violation.kind == MEMORY and violation.container_id == "c1"
    assert violation.used_mib == 6000 and violation.pids == (102,)


def test_a_sibling_cgroup_with_a_common_name_prefix_is_not_the_container():
    # /pod-a/c10 is not below /pod-a/c1: its process is outside any registration.
    violations = find([registration()], [shared()], [proc(101, 100, path="/pod-a/c10")])
    assert [v.kind for v in violations] == [UNALLOCATED]


def test_registration_on_a_v1_hierarchy_matches_that_hierarchy_only():
    reg = Registration("c1", "ga-1", CgroupKey("memory", "/kube/c1"), 10, 1000, None, 1.0)
    inside = GpuProcess(101, GPU0, 5000, 1, {"memory": "/kube/c1/x", "": "/"}, QUOTA_ENV)
    [violation] = find([reg], [shared()], [inside])
    assert violation.kind == MEMORY


def test_memory_is_per_allocation():
    """Two allocations' processes never add up, each within its own quota."""
    regs = [registration("c1", "ga-1", "/pod-a/c1"), registration("c2", "ga-2", "/pod-b/c2")]
    allocations = [shared("ga-1"), shared("ga-2")]
    processes = [proc(101, 3000), proc(102, 3000, path="/pod-b/c2")]
    assert find(regs, allocations, processes) == []


def test_memory_is_summed_over_every_container_of_the_allocation():
    """Issue 14, item 4: three containers on one 4096 MiB allocation at 4000 MiB each are
    one allocation at 12000 MiB, not three within quota. The newest processes across the
    whole allocation are named until it is within quota + grace; the violation names the
    allocation, its pod and its containers, and is keyed by the allocation."""
    sidecar = ContainerRef("default", "a", "sidecar")
    regs = [
        registration("c1", "ga-1", "/pod-a/c1"),
        registration("c2", "ga-1", "/pod-a/c2", identity=sidecar),
        registration("c3", "ga-1", "/pod-a/c3"),
    ]
    processes = [
        proc(101, 4000, 100, path="/pod-a/c1"),
        proc(102, 4000, 300, path="/pod-a/c2"),
        proc(103, 4000, 200, path="/pod-a/c3"),
    ]
    [violation] = find(regs, [shared()], processes)
    assert violation.kind == MEMORY and violation.key == (MEMORY, "ga-1")
    assert (violation.used_mib, violation.quota_mib) == (12000, 4096)
    assert violation.pids == (102, 103)  # 4000 MiB left, within 4096 + 128
    assert violation.allocation_id == "ga-1"
    assert violation.container_id == "c2"  # its process goes first
    assert violation.owner == sidecar  # no owner from kubelet yet: an identity registered
    assert "allocation ga-1 (pod default/a, container(s) c1, c2, c3)" in violation.detail
    assert "use 12000 MiB together, over the quota of 4096 MiB (+128 MiB grace)" in violation.detail


def test_the_memory_violation_names_kubelets_owner():
    """kubelet's owner of the allocation names the pod, whatever identities registered."""
    owner = ContainerRef("team", "train", "main")
    [violation] = find([registration()], [shared(owner=owner)], [proc(101, 5000)])
    assert violation.owner == owner and "(pod team/train, container(s) c1)" in violation.detail


def test_allocation_use_is_what_its_memory_check_sums():
    """The status's per-allocation use: every container of the allocation on its card, so
    it shows what the watchdog judged (not a process on another card, nor one whose
    allocation was released)."""
    regs = [
        registration("c1", "ga-1", "/pod-a/c1"),
        registration("c2", "ga-1", "/pod-a/c2"),
        registration("c3", "ga-gone", "/pod-c/c3"),
    ]
    processes = [
        proc(101, 1000, path="/pod-a/c1"),
        proc(102, 2000, path="/pod-a/c2"),
        proc(103, 700, card=GPU1, path="/pod-a/c2"),
        proc(104, 500, path="/pod-c/c3"),
        proc(105, 300, path="/elsewhere"),
    ]
    allocations = {"ga-1": shared()}
    assert allocation_used_mib(regs, allocations, processes) == {"ga-1": 3000}
    over = [*processes, proc(106, 2000, path="/pod-a/c1")]
    [memory] = [v for v in find(regs, [shared()], over, (GPU0, GPU1)) if v.kind == MEMORY]
    assert memory.used_mib == allocation_used_mib(regs, allocations, over)["ga-1"] == 5000


def test_share_only_allocation_has_no_memory_check():
    allocation = shared(units=0)
    env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}
    assert find([registration()], [allocation], [proc(101, 9000, env=env)]) == []


# --- env -------------------------------------------------------------------------------------


def test_process_without_quota_env_is_an_env_violation():
    [violation] = find([registration()], [shared()], [proc(101, 100, 555, env={})])
    assert violation.kind == ENV and violation.pids == (101,)
    assert violation.container_id == "c1" and violation.allocation_id == "ga-1"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT was removed" in violation.detail


def test_process_raising_its_quota_env_is_an_env_violation():
    env = {**QUOTA_ENV, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}
    [violation] = find([registration()], [shared()], [proc(101, 100, env=env)])
    assert violation.kind == ENV and "outside the share of 30%" in violation.detail


def test_process_lowering_its_quota_env_is_fine():
    env = {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1G", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "5"}
    assert find([registration()], [shared()], [proc(101, 100, env=env)]) == []


def test_env_and_memory_violations_are_reported_together():
    processes = [proc(101, 3000, 100), proc(102, 3000, 200, env={})]
    violations = find([registration()], [shared()], processes)
    assert sorted(v.kind for v in violations) == [ENV, MEMORY]


# --- unallocated -----------------------------------------------------------------------------


def test_process_on_a_shared_card_outside_any_registration_is_unallocated():
    [violation] = find([], [shared()], [proc(101, 500, path="/system.slice/miner")])
    assert violation.kind == UNALLOCATED and violation.pids == (101,)
    assert violation.container_id is None and violation.allocation_id is None
    assert "belongs to no registered container" in violation.detail


def test_process_whose_allocation_is_gone_is_unallocated():
    [violation] = find([registration()], [], [proc(101, 500)])
    assert violation.kind == UNALLOCATED and violation.container_id == "c1"
    assert violation.owner == POD_A
    assert "allocation ga-1 was released" in violation.detail


def test_process_on_a_card_its_allocation_does_not_hold_is_unallocated():
    process = proc(101, 500, card=GPU1)
    [violation] = find([registration()], [shared()], [process])
    assert violation.kind == UNALLOCATED and violation.card_uuid == GPU1
    assert violation.allocation_id == "ga-1"
    assert f"holds {GPU0}, not this card" in violation.detail


def test_process_on_a_card_outside_its_allocation_does_not_count_toward_its_memory():
    processes = [proc(101, 3000), proc(102, 3000, card=GPU1)]
    violations = find([registration()], [shared()], processes)
    assert [v.kind for v in violations] == [UNALLOCATED]


def test_a_process_on_a_whole_card_outside_its_allocation_is_unallocated():
    """A card given out whole is policed as a shared one is: a process of no registered
    container there, and one whose allocation holds another card, are unallocated; the
    whole allocation's own processes are not judged (no quota, no env)."""
    owner = registration("cw", "ga-w", "/pod-w/cw")
    processes = [
        proc(101, 8192, card=GPU1, path="/host/job"),
        proc(102, 2048, card=GPU1),
        proc(103, 4096, card=GPU1, path="/pod-w/cw", env={}),
    ]
    violations = find([registration(), owner], [shared(), whole()], processes, whole_cards=(GPU1,))
    assert sorted((v.kind, v.pids) for v in violations) == [
        (UNALLOCATED, (101,)),
        (UNALLOCATED, (102,)),
    ]
    assert all("a card given out whole" in v.detail for v in violations)


def test_whole_allocations_get_no_memory_or_env_checks():
    reg = registration("cw", "ga-w", "/pod-w/cw")
    processes = [proc(101, 15000, card=GPU1, path="/pod-w/cw", env={})]
    # Even when the card is (wrongly) listed as shared, the registration covers it.
    assert find([reg], [whole()], processes) == []


# --- keys ------------------------------------------------------------------------------------


def test_keys_are_stable_across_calls():
    regs = [registration()]
    allocations = [shared()]

    def scan(used):
        return find(
            regs,
            allocations,
            [
                proc(101, used, 100),
                proc(102, used, 200),
                proc(103, 10, 300, env={}),
                proc(104, 10, 400, path="/elsewhere"),
            ],
        )

    first, second = scan(3000), scan(3500)
    assert {v.kind: v.key for v in first} == {v.kind: v.key for v in second}
    keys = {v.kind: v.key for v in first}
    assert keys[MEMORY] == (MEMORY, "ga-1")
    assert keys[ENV] == (ENV, 103, 300)
    assert keys[UNALLOCATED] == (UNALLOCATED, 104, 400)
    # A reused PID (another start time) is another violation.
    reused = find([], allocations, [proc(104, 10, 401, path="/elsewhere")])
    assert reused[0].key != keys[UNALLOCATED]


def test_unparseable_quota_env_is_an_env_violation_not_a_crash():
    regs = [registration("c1", "ga-1", "/pod-a/c1"), registration("c2", "ga-2", "/pod-b/c2")]
    allocations = [shared("ga-1"), shared("ga-2")]
    bad_env = {**QUOTA_ENV, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=²M"}
    processes = [proc(101, 100, env=bad_env), proc(102, 9000, path="/pod-b/c2")]
    violations = find(regs, allocations, processes)
    assert sorted((v.kind, v.container_id) for v in violations) == [(ENV, "c1"), (MEMORY, "c2")]


# --- quota env read exactly (issue 14, item 8) and unreadable processes (item 3) -------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "٣٠"),  # Arabic-Indic 30: float() reads 30.0
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "３０"),  # fullwidth 30
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", " 30"),
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "3_0"),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=\u00a04096M"),  # NBSP after '='
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "\u20030=4096M"),
    ],
)
def test_a_quota_env_value_not_in_its_exact_ascii_form_is_an_env_violation(name, value):
    env = {**QUOTA_ENV, name: value}
    [violation] = find([registration()], [shared()], [proc(101, 100, env=env)])
    assert violation.kind == ENV and violation.pids == (101,)
    assert name in violation.detail and "ASCII" in violation.detail


def test_a_process_whose_env_cannot_be_read_is_an_env_violation():
    """Fail closed: an unreadable environ (over the cap, unreadable) hides the quota env."""
    process = GpuProcess(101, GPU0, 100, 1010, {"": "/pod-a/c1"}, {}, env_problem="too large")
    [violation] = find([registration()], [shared()], [process])
    assert violation.kind == ENV and "too large" in violation.detail


def test_a_process_whose_cgroup_cannot_be_read_is_unallocated_saying_why():
    """Fail closed: no identity means no container, so GPU memory held is unallocated."""
    process = GpuProcess(101, GPU0, 100, 1010, {}, dict(QUOTA_ENV), cgroup_problem="not UTF-8")
    [violation] = find([registration()], [shared()], [process])
    assert violation.kind == UNALLOCATED and "not UTF-8" in violation.detail


# --- MPS control holds -----------------------------------------------------------------------


HOLD = ControlHold(GPU0, 10, 11, ((101, 1010), (102, 1020)))


def held_by(*holders, registrations=(), allocations=()):
    index = index_registrations(list(registrations))
    return control_hold_violation(HOLD, list(holders), index, {a.id: a for a in allocations})


def test_a_registered_containers_process_holding_the_control_daemon_is_acted_on():
    """Named with its container and pod, tied to its allocation; its PID is what kill stops;
    the key names the connection (stable while it lasts)."""
    holder = HolderProcess(101, 1010, {"": "/pod-a/c1/sub"}, host_mount_ns=False)
    violation = held_by(holder, registrations=[registration()], allocations=[shared()])
    assert violation.kind == MPS_CONTROL and violation.card_uuid == GPU0
    assert violation.pids == (101,) and violation.owner == POD_A
    assert (violation.container_id, violation.allocation_id) == ("c1", "ga-1")
    assert "process 101 (container c1, pod default/a)" in violation.detail
    assert "sends nothing, or reads nothing" in violation.detail
    assert violation.key == (MPS_CONTROL, GPU0, 10, 11)


def test_a_container_of_no_allocation_is_acted_on_a_host_process_only_named():
    """Another mount namespace outside every service: a container, acted on. The host's
    mount namespace, a service with a namespace of its own (PrivateTmp=) or one that cannot
    be read: the host's, named and not killed."""
    container = HolderProcess(101, 1010, {"": "/kubepods/pod1/abc"}, host_mount_ns=False)
    host = HolderProcess(102, 1020, {"": "/user.slice/session-1.scope"}, host_mount_ns=True)
    service = HolderProcess(103, 1030, {"": "/system.slice/x.service"}, host_mount_ns=False)
    unknown = HolderProcess(104, 1040, {}, "unreadable", host_mount_ns=None)
    violation = held_by(container, host, service, unknown)
    assert violation.pids == (101,) and violation.owner is None
    assert "process 101 (in a container of no registered allocation" in violation.detail
    host_words = "(in no container: a process of the host's, named and not killed)"
    for pid in (102, 103, 104):
        assert f"process {pid} {host_words}" in violation.detail


def test_a_container_holding_again_loses_its_init_process_too():
    """A registered container named in ``repeat`` (it held MPS lately through another
    connection) has its init process added to what kill stops, once, and the detail says
    the container stops."""
    holder = HolderProcess(101, 1010, {"": "/pod-a/c1"}, host_mount_ns=False)
    other = HolderProcess(102, 1020, {"": "/pod-a/c1"}, host_mount_ns=False)
    violation = held_by(holder, other, registrations=[registration()], allocations=[shared()])
    assert violation.pids == (101, 102)
    index = index_registrations([registration()])
    again = control_hold_violation(HOLD, [holder, other], index, {"ga-1": shared()}, {"c1"})
    assert again.pids == (101, 10, 102)  # registration()'s init process is PID 10
    assert "its init process 10 too, so the container stops" in again.detail
