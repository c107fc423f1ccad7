"""What every fault of the matrix must leave intact, checked the same way after each one.

After a fault (and after the daemon, where the fault stopped it, was started again as
systemd would start it), ``after_fault`` checks:

1. ``nodemgr check-ledger`` passes: no device in two allocations, every card within its
   capacity, no container registered to a freed allocation;
2. once a reconcile has run, the ledger says what kubelet's record says: every device
   kubelet gives a container is held by an allocation of that container (0 lost), the
   ledger holds no device kubelet gives nobody, no device is held twice and none by an
   allocation of another container (0 double-booked); the allocations admitted before
   the fault keep their IDs (the ID in each pod's env);
3. every admitted pod still works: a new container of the pod, started through runc with
   the env kubelet gave it and its pod's CRI identity, is admitted by the runtime hook;
   the watchdog kills it once the pod's processes together go over the quota, and spares
   the pod's long-running container (started before the faults, so still registered on
   the allocation: a process of no registered container would be killed as unallocated).

The pods' counts go into the docs/faults.md row (``Kept.row``) as observed, never as constants.
"""

from __future__ import annotations

import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass

from nodemgr.allocation.audit import card_capacities
from nodemgr.allocation.ledger import Ledger
from nodemgr.config.loading import load_settings
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.invariants import check_invariants
from nodemgr.domain.model import Allocation, ContainerRef, Registration
from standins import runc_env
from standins.daemon_proc import CORE, MEMORY, WHOLE
from standins.kubelet_sim import AdmitResult, ContainerSpec

KINDS = {MEMORY: ResourceKind.MEMORY, CORE: ResourceKind.CORE, WHOLE: ResourceKind.WHOLE}
NAMESPACE = "default"
CONTAINER = "main"
# The pod's long-running container holds this much; a new container at the pod's whole
# quota then puts the pod over quota + enforcement.grace_mib (128 MiB by default).
RUNNER_USE_MIB = 256
# That the watchdog kills is checked here, not how fast: test_runc_enforcement pins the
# 2 s promise, on a node that is not also restarting daemons and containers.
KILL_WAIT_SECONDS = 10.0
# allocation_grace_seconds (3 s in the tests' config) plus reconciles (every 0.5 s).
SETTLE_SECONDS = 20.0
SERVING_SECONDS = 60.0
_LIMIT = re.compile(r"0=([0-9]+)M")


@dataclass
class Pod:
    """An admitted one-container pod: the env and mounts kubelet gave its container."""

    name: str
    env: dict[str, str]
    mounts: list[tuple[str, str]]
    runner: str | None = None  # its long-running container, if it has one
    runner_pid: int = 0
    restarts: int = 0  # how many times its long-running container was started

    @property
    def allocation_id(self) -> str:
        return self.env["GPUSHARE_ALLOCATION_ID"]

    @property
    def card(self) -> str:
        return self.env["NVIDIA_VISIBLE_DEVICES"]

    @property
    def quota_mib(self) -> int:
        match = _LIMIT.fullmatch(self.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"])
        assert match, f"{self.name}: no pinned memory limit in {self.env}"
        return int(match.group(1))


def pod_from(name: str, result: AdmitResult) -> Pod:
    """The pod kubelet admitted (``result`` of ``TestKubelet.admit_pod``)."""
    assert result.ok, f"{name}: {result.error}"
    [container] = result.containers
    mounts = {
        (m.container_path, m.host_path)
        for response in container.responses.values()
        for m in response.mounts
    }
    return Pod(name, dict(container.envs), sorted(mounts))


# Without the Kubernetes API the daemon sees a container's resources one at a time; a share
# placed first may leave its card no room for the memory (docs/how-it-works.md). The faults
# are not about that order, so every pod of the matrix asks its memory first.
MEMORY_FIRST = [MEMORY, CORE]


def admit(
    cluster,
    name: str,
    memory_gib: int,
    core_percent: int,
    runner: bool = True,
    order: list[str] | None = None,
) -> Pod:
    """Admit a pod through the test kubelet; with ``runner``, start its long-running
    container through runc (as kubelet's runtime would). ``order``: the order of its
    resources (None: MEMORY_FIRST)."""
    spec = ContainerSpec(CONTAINER, {MEMORY: memory_gib, CORE: core_percent})
    pod = pod_from(
        name, cluster.kubelet.admit_pod(NAMESPACE, name, [spec], order=order or MEMORY_FIRST)
    )
    if runner:
        start_runner(cluster, pod)
    return pod


def start_runner(cluster, pod: Pod) -> None:
    """(Re)start the pod's long-running container."""
    pod.restarts += 1
    pod.runner = f"{pod.name}-run{pod.restarts}"
    done = cluster.start_in_pod(pod.runner, pod.name, pod.env, pod.mounts)
    assert done.returncode == 0, f"{pod.runner}: {done.stdout}"
    pod.runner_pid = cluster.runtime.pid(pod.runner)


@dataclass(frozen=True)
class Kept:
    """What the checks found after one fault."""

    pods: int  # pods admitted before the fault
    same_ids: int  # of them, allocations in the ledger under the ID in their env
    double_booked: int  # devices held twice, or held by an allocation of another container
    runners: int  # long-running containers still running and registered
    policed: int  # pods whose new container was admitted and killed over quota
    extra: int  # pods admitted during the fault, checked as the others

    def row(self, runners_restarted: bool = False) -> str:
        runners = (
            f"containers started again after it registered ({self.runners}/{self.pods})"
            if runners_restarted
            else f"{self.runners}/{self.pods} running containers kept"
        )
        text = (
            f"{self.same_ids}/{self.pods} allocations with their IDs, "
            f"{self.double_booked} double-booked; {runners}; new containers admitted and "
            f"killed over quota ({self.policed}/{self.pods + self.extra} pods)"
        )
        if self.extra:
            text += "; every allocation kubelet made during the fault is in the ledger"
        return text


def kubelet_record(kubelet) -> dict[ContainerRef, dict[ResourceKind, list[str]]]:
    """kubelet's record of who holds which device, as ``check_invariants`` takes it."""
    record = {}
    for (namespace, pod, container), resources in kubelet.allocated().items():
        held = {KINDS[resource]: ids for resource, ids in resources.items() if ids}
        if held:
            record[ContainerRef(namespace, pod, container)] = held
    return record


def state_dir(cluster) -> str:
    return os.path.join(cluster.node.root, "state")


def read_ledger(cluster) -> tuple[list[Allocation], list[Registration]]:
    """The ledger as it is on disk (read-only: the running daemon is not disturbed)."""
    ledger = Ledger(state_dir(cluster), read_only=True)
    try:
        return ledger.load(), ledger.load_registrations()
    finally:
        ledger.close()


def double_booked(
    allocations: list[Allocation], record: dict[ContainerRef, dict[ResourceKind, list[str]]]
) -> int:
    """Devices held by two allocations, or by an allocation of a container other than the
    one kubelet gave them to."""
    holders: dict[tuple[ResourceKind, str], set[str]] = defaultdict(set)
    owners: dict[tuple[ResourceKind, str], set[ContainerRef]] = defaultdict(set)
    for allocation in allocations:
        for pair in allocation.device_pairs():
            holders[pair].add(allocation.id)
            if allocation.owner is not None:
                owners[pair].add(allocation.owner)
    twice = {pair for pair, ids in holders.items() if len(ids) > 1}
    for ref, held in record.items():
        for kind, ids in held.items():
            twice.update((kind, i) for i in ids if owners[(kind, i)] - {ref})
    return len(twice)


def ledger_problems(cluster) -> list[str]:
    """Every way the ledger disagrees with its invariants or with kubelet's record."""
    settings = load_settings(cluster.node.config_path)
    cards, why = card_capacities(settings)
    assert cards is not None, why
    allocations, registrations = read_ledger(cluster)
    record = kubelet_record(cluster.kubelet)
    unit = settings.resources.memory_unit_mib
    problems = check_invariants(allocations, cards, unit, registrations, kubelet_record=record)
    given = {(kind, i) for held in record.values() for kind, ids in held.items() for i in ids}
    for allocation in allocations:
        if allocation.owner is None:
            problems.append(f"allocation {allocation.id} has no owner: no reconcile yet")
        for kind, device_id in allocation.device_pairs():
            if (kind, device_id) not in given:
                problems.append(
                    f"allocation {allocation.id} ({allocation.owner}) holds {device_id} "
                    f"({kind}), which kubelet gives no container"
                )
    return problems


def settle(cluster) -> list[Allocation]:
    """Wait until the ledger agrees with kubelet (a reconcile ran); its allocations."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        problems = ledger_problems(cluster)
        if not problems:
            return read_ledger(cluster)[0]
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the ledger still disagrees with kubelet after {SETTLE_SECONDS} s: {problems}"
                f"\ndaemon log (end):\n{cluster.node.log()[-4000:]}"
            )
        time.sleep(0.2)


def wait_serving(cluster, timeout: float = SERVING_SECONDS) -> None:
    """The daemon runs and kubelet sees every shared device Healthy."""
    process = cluster.node.process
    assert process is not None and process.poll() is None, (
        f"gpushare-node is not running; log (end):\n{cluster.node.log()[-4000:]}"
    )
    for resource in (MEMORY, CORE):
        cluster.kubelet.wait_for_devices(
            resource, lambda ds: bool(ds) and all(d.healthy for d in ds), timeout=timeout
        )


def start_daemon(cluster, timeout: float = SERVING_SECONDS) -> None:
    """Start gpushare-node (as systemd would) and wait until it registered and serves."""
    seen = len(cluster.kubelet.registrations())

    def registered() -> bool:
        fresh = cluster.kubelet.registrations()[seen:]
        return len({r.resource_name for r in fresh if r.error is None}) == len(KINDS)

    cluster.node.start()
    cluster.node.wait_for(registered, timeout=timeout, what="registration with kubelet")
    wait_serving(cluster, timeout)


def registered_containers(cluster) -> set[str]:
    return {r.container_id for r in read_ledger(cluster)[1]}


def pods_work(cluster, pods: list[Pod], tag: str) -> int:
    """Check 3 above for every pod; the number of pods that passed (all, or it raises)."""
    started = []
    try:
        for pod in pods:
            name = f"{pod.name}-{tag}"
            done = cluster.start_in_pod(name, pod.name, pod.env, pod.mounts)
            assert done.returncode == 0, f"a new container of {pod.name} was refused: {done.stdout}"
            started.append((pod, name, cluster.runtime.pid(name)))
        registered = registered_containers(cluster)
        expected = [name for _, name, _ in started] + [p.runner for p in pods if p.runner]
        assert set(expected) <= registered, f"not registered: {set(expected) - registered}"
        usage = []
        for pod, _, pid in started:
            if pod.runner:
                usage.append((pod.runner_pid, pod.card, RUNNER_USE_MIB))
                usage.append((pid, pod.card, pod.quota_mib))
            else:
                usage.append((pid, pod.card, pod.quota_mib + RUNNER_USE_MIB))
        cluster.set_usage(usage)
        deadline = time.monotonic() + KILL_WAIT_SECONDS
        while time.monotonic() < deadline and any(runc_env.running(p) for _, _, p in started):
            time.sleep(0.05)
        over = [name for _, name, pid in started if runc_env.running(pid)]
        assert not over, (
            f"the watchdog did not kill {over} over quota\n{cluster.node.log()[-3000:]}"
        )
        spared = [p.runner for p in pods if p.runner and not runc_env.running(p.runner_pid)]
        assert not spared, f"long-running containers killed: {spared}"
    finally:
        cluster.set_usage([])
        for _, name, _ in started:
            cluster.runtime.delete(name)
    return len(started)


def after_fault(
    cluster, pods: list[Pod], tag: str, extra: tuple[Pod, ...] | list[Pod] = ()
) -> Kept:
    """Every check above; ``extra``: pods admitted during the fault (checked the same)."""
    wait_serving(cluster)
    check = cluster.node.nodemgr("check-ledger")
    assert check.returncode == 0, f"nodemgr check-ledger: {check.stdout}{check.stderr}"
    allocations = settle(cluster)
    by_id = {a.id: a for a in allocations}
    everyone = [*pods, *extra]
    same = [
        p
        for p in everyone
        if (a := by_id.get(p.allocation_id)) is not None
        and a.owner == ContainerRef(NAMESPACE, p.name, CONTAINER)
    ]
    lost = [p.name for p in everyone if p not in same]
    assert not lost, f"allocations lost or renamed: {lost} (ledger: {sorted(by_id)})"
    double = double_booked(allocations, kubelet_record(cluster.kubelet))
    assert double == 0, f"{double} devices double-booked"
    runners = sum(1 for p in pods if p.runner and runc_env.running(p.runner_pid))
    policed = pods_work(cluster, everyone, tag)
    return Kept(
        pods=len(pods),
        same_ids=sum(1 for p in pods if p in same),
        double_booked=double,
        runners=runners,
        policed=policed,
        extra=len(extra),
    )
