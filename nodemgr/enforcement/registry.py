"""The containers the runtime hook let start, and the hook's decisions.

``admit`` checks a new container's GPU env and spec against its live allocation and,
when they match, registers its cgroup in the ledger, so the watchdog can tell whose GPU
process is whose, also after a restart. ``release`` is the poststop side.

The container must be tied to the allocation by its pod (:mod:`nodemgr.domain.podtie`),
through kubelet's record read at that moment: it knows a pod is gone before the next
reconcile does. Every GPU container is refused while kubelet cannot answer (kubelet
creates every pod container, so none is being made anyway) and while the watchdog
cannot judge (it would run unpoliced).

What it must not do: parse the wire protocol (the hook server does) or act
on running processes (the watchdog does).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from hooks import gpuenv
from hooks.specfacts import normpath, nvidia_named
from hooks.textsafe import quote
from mps.layout import MpsLayout
from nodemgr.allocation.ledger import Ledger
from nodemgr.domain.containercheck import (
    CgroupError,
    check_container,
    container_cgroup,
    identity_conflict,
)
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import Allocation, ContainerRef, Registration
from nodemgr.domain.podtie import (
    NO_IDENTITY,
    KubeletRecord,
    holders,
    pod_of,
    pod_tie_problem,
    pods_allocation,
    shown_pod,
)
from nodemgr.domain.speccheck import (
    CardNode,
    DaemonPaths,
    Grant,
    NodeGpus,
    SpecFacts,
    spec_problem,
)
from nodemgr.enforcement import hostdevices, procfs
from nodemgr.enforcement.cgroupmarks import CgroupMarks
from nodemgr.errors import GpushareError, LedgerError
from nodemgr.inventory import Card

log = logging.getLogger(__name__)


class AdmissionState(Protocol):
    """The Allocator, as the registry sees it."""

    @property
    def cards(self) -> Sequence[Card]: ...
    @property
    def resource_names(self) -> Mapping[ResourceKind, str]: ...
    def allocation(self, allocation_id: str) -> Allocation | None: ...
    def allocations(self) -> list[Allocation]: ...
    def request_reconcile(self) -> None: ...

    def awaiting_adoption(self) -> set[str]:
        """Allocation IDs taken back from cgroup marks that the next reconcile is to adopt
        from kubelet's record (a lost ledger recovered while kubelet could not be read)."""
        ...


class ContainerRegistry:
    def __init__(
        self,
        ledger: Ledger,
        allocator: AdmissionState,
        mps_pipe_directory: str | None,
        clock: Callable[[], float] = time.time,
        kubelet_record: Callable[[], KubeletRecord] | None = None,
        mps_layout: MpsLayout | None = None,
        marks: CgroupMarks | None = None,
        daemon_paths: DaemonPaths | None = None,
    ):
        """``kubelet_record`` (kubelet's PodResources List) None trusts the ledger alone
        (tests); ``mps_layout`` None: MPS off."""
        self._ledger = ledger
        self._allocator = allocator
        self._mps_pipe_directory = mps_pipe_directory
        self._clock = clock
        self._kubelet_record = kubelet_record
        # A lost ledger is recovered from these marks (nodemgr.enforcement.cgroupmarks).
        self._marks = marks
        self._card_uuids_by_index = {str(card.index): card.uuid for card in allocator.cards}
        self._gpus = node_gpus(allocator.cards, mps_layout, daemon_paths)
        self._lock = threading.Lock()
        self._registrations = {r.container_id: r for r in ledger.load_registrations()}
        # The watchdog's problem, wired in once it exists (it is made after the registry).
        self.enforcement_problem: Callable[[], str | None] = lambda: None

    def admit(
        self,
        container_id: str,
        pid: int,
        env: dict[str, str],
        identity: ContainerRef | None,
        cgroup_text: str,
        spec: SpecFacts | None = None,
        identity_problem: str | None = None,
        pod_uid: str | None = None,
    ) -> tuple[bool, str]:
        """(allowed, message); registers it if allowed. ``spec`` None checks the env alone;
        ``identity_problem``: why its annotations give no trustworthy pod identity."""
        who = f"container {quote(container_id)}" + (f" ({identity})" if identity else "")
        if not gpuenv.needs_daemon(env):
            return self._no_gpu_answer(who, spec)
        if identity_problem is not None:
            message = f"gpushare-node refused {who}: {identity_problem}"
            log.warning("%s", message)
            return False, message
        allocation, record, alias = self._judged_allocation(who, identity, env, pod_uid)
        problem = self._unpoliced() or self._env_problem(env, allocation, spec, alias)
        if problem is None and allocation is not None and gpuenv.requested_gpus(env) is None:
            return True, f"{who} holds allocation {allocation.id} but asks for no GPU"
        if problem is None and allocation is not None:
            problem = self._tie_problem(identity, allocation, record, pod_uid)
        with self._lock:
            if problem is None and allocation is not None:
                others = [
                    r.identity
                    for r in self._registrations.values()
                    if r.allocation_id == allocation.id
                    and r.identity is not None
                    and r.container_id != container_id
                ]
                problem = identity_conflict(identity, allocation, others)
            if problem is None:
                try:
                    cgroup = container_cgroup(cgroup_text, container_id)
                except CgroupError as e:
                    problem = str(e)
            start_ticks = None
            if problem is None:
                start_ticks, problem = _init_start_ticks(pid)
            if problem is not None:
                message = f"gpushare-node refused {who}: {problem}"
                log.warning("%s", message)
                return False, message
            # No problem: check_container found the allocation, and the start time was read.
            assert allocation is not None
            assert start_ticks is not None
            registration = Registration(
                container_id=container_id,
                allocation_id=allocation.id,
                cgroup=cgroup,
                init_pid=pid,
                init_start_ticks=start_ticks,
                identity=identity,
                registered_at=self._clock(),
            )
            try:
                self._ledger.put_registration(registration)
            except LedgerError as e:
                log.error("cannot register %s: %s", who, e)
                return False, f"gpushare-node refused {who}: cannot record it ({e})"
            self._registrations[container_id] = registration
        self._mark(who, registration)
        log.info(
            "registered %s on allocation %s (%s), cgroup %s",
            who,
            allocation.id,
            ", ".join(allocation.cards),
            cgroup,
        )
        return True, f"{who} registered on allocation {allocation.id}"

    def _env_problem(
        self,
        env: dict[str, str],
        allocation: Allocation | None,
        spec: SpecFacts | None,
        alias: str | None,
    ) -> str | None:
        """``alias``: why ``allocation`` is not the one the env names."""
        problem = check_container(
            env, allocation, self._card_uuids_by_index, self._mps_pipe_directory
        ) or self._spec_problem(spec, allocation, env)
        if problem is not None and allocation is not None and alias is not None:
            problem = f"{alias}; judged against its pod's own allocation {allocation.id}: {problem}"
        return problem

    def _unpoliced(self) -> str | None:
        blind = self.enforcement_problem()
        if blind is None:
            return None
        return (
            f"{blind}; a GPU container would run unpoliced (the watchdog tries again at "
            "every scan; `nodemgr status` says why)"
        )

    def _no_gpu_answer(self, who: str, spec: SpecFacts | None) -> tuple[bool, str]:
        problem = self._spec_problem(spec, None, {})
        if problem is not None:
            log.warning("gpushare-node refused %s: %s", who, problem)
            return False, f"gpushare-node refused {who}: {problem}"
        return True, f"{who} asks for no GPU"

    def _spec_problem(
        self, spec: SpecFacts | None, allocation: Allocation | None, env: dict[str, str]
    ) -> str | None:
        if spec is None:
            return None
        node = self._gpus_now(spec)
        if isinstance(node, str):
            return node
        grant = None
        if allocation is not None:
            grant = Grant(allocation.id, allocation.cards, shared=not allocation.whole)
        asks = gpuenv.requested_gpus(env) is not None
        return spec_problem(spec, grant, node, env_asks_gpus=asks)

    def _gpus_now(self, spec: SpecFacts) -> NodeGpus | str:
        """The node's GPUs with the host's NVIDIA device numbers now, or why they cannot be
        read (fail closed); read only for a spec with device nodes or rules."""
        if not (spec.devices or spec.rules or any(m.nodes for m in spec.mounts)):
            return self._gpus
        try:
            majors = hostdevices.nvidia_majors()
        except hostdevices.HostDevicesError as e:
            return (
                f"NVIDIA's device numbers on this host cannot be read ({e}), so its device "
                "nodes and rules cannot be judged"
            )
        names = {normpath(d.path) for d in spec.devices if nvidia_named(normpath(d.path))}
        nodes = {name: hostdevices.host_node(name) for name in names}
        return replace(self._gpus, control_majors=majors, host_nodes=nodes)

    def _judged_allocation(
        self, who: str, identity: ContainerRef | None, env: dict[str, str], pod_uid: str | None
    ) -> tuple[Allocation | None, KubeletRecord | str | None, str | None]:
        allocation_id = env.get(gpuenv.ALLOCATION_ID)
        allocation = self._allocator.allocation(allocation_id) if allocation_id else None
        record = self._read_record(identity, env)  # outside the lock: a local RPC
        if allocation_id and identity is not None and not isinstance(record, str):
            own, alias = self._own_allocation(who, identity, env, allocation, record, pod_uid)
            return own, record, alias
        return allocation, record, None

    def _read_record(
        self, identity: ContainerRef | None, env: dict[str, str]
    ) -> KubeletRecord | str | None:
        """str: why it could not be read; None: nothing to ask (no kubelet, no identity)."""
        if self._kubelet_record is None or identity is None:
            return None
        if gpuenv.requested_gpus(env) is None:
            return None
        try:
            return self._kubelet_record()
        except GpushareError as e:
            return (
                f"cannot ask kubelet whether allocation {env.get(gpuenv.ALLOCATION_ID)} is "
                f"still held ({e}); "
                "GPU containers start again once kubelet answers"
            )

    def _own_allocation(
        self,
        who: str,
        identity: ContainerRef,
        env: dict[str, str],
        named: Allocation | None,
        record: KubeletRecord | None,
        pod_uid: str | None,
    ) -> tuple[Allocation | None, str | None]:
        """The one its env names, unless kubelet's record gives its pod another
        (nodemgr.domain.podtie.pods_allocation)."""
        if record is None:
            return named, None
        names = self._allocator.resource_names
        holding = holders(named, record, names) if named else set()
        if pod_of(identity) in {pod_of(ref) for ref in holding}:
            return named, None  # judged by the tie (another pod of the name is refused there)
        requested = gpuenv.requested_gpus(env) or []
        cards = {self._card_uuids_by_index.get(item, item) for item in requested}
        allocations = self._allocator.allocations()
        own = pods_allocation(identity, allocations, record, names, cards, pod_uid)
        if own is None:
            return named, None
        named_id = quote(env.get(gpuenv.ALLOCATION_ID, ""))
        pods = ", ".join(sorted({shown_pod(ref) for ref in holding}))
        alias = f"its env names allocation {named_id}, which " + (
            f"kubelet's record gives to pod {pods}, not to pod {shown_pod(identity)}"
            if pods
            else "is not live here (the ledger was rebuilt, or the allocation split)"
        )
        log.warning(
            "%s: its env names allocation %s, which kubelet's record does not give to pod %s; "
            "it holds allocation %s (%s): judged against that one (the env's ID went stale: "
            "the ledger was rebuilt, or a mislinked allocation was split)",
            who,
            named_id,
            shown_pod(identity),
            own.id,
            ", ".join(own.cards),
        )
        return own, alias

    def _tie_problem(
        self,
        identity: ContainerRef | None,
        allocation: Allocation,
        record: KubeletRecord | str | None,
        pod_uid: str | None = None,
    ) -> str | None:
        if identity is None:
            return NO_IDENTITY
        if self._kubelet_record is None:
            return None  # no kubelet to ask (tests): identity_conflict alone binds it
        if isinstance(record, str):
            return record
        if record is None:
            return None  # asks for no GPU (handled before): nothing to tie
        holding = holders(allocation, record, self._allocator.resource_names)
        if not holding or len({pod_of(ref) for ref in holding}) > 1:
            self._allocator.request_reconcile()  # the run loop releases or splits it now
        if not holding:
            return (
                f"kubelet no longer reports allocation {allocation.id} "
                f"({', '.join(allocation.cards)}) for any container: its pod is gone "
                "(or was refused), so the allocation grants nothing"
            )
        return pod_tie_problem(identity, allocation, holding, pod_uid)

    def _mark(self, who: str, registration: Registration) -> None:
        if self._marks is None:
            return
        problem = self._marks.write(registration)
        if problem is not None:  # it runs: only a lost ledger could not recover it
            log.warning("%s: its cgroup is not marked (%s)", who, problem)

    def release(self, container_id: str, why: str = "stopped") -> bool:
        with self._lock:
            registration = self._registrations.pop(container_id, None)
            if registration is None:
                return False
            try:
                self._ledger.delete_registration(container_id)
            except LedgerError as e:
                # The row comes back at the next start and is pruned then.
                log.error("cannot unregister container %s: %s", container_id, e)
        log.info("unregistered container %s (%s)", container_id, why)
        return True

    def registrations(self) -> list[Registration]:
        with self._lock:
            return list(self._registrations.values())

    def prune(self) -> None:
        """Drop containers whose init process is gone without a poststop, and those whose
        allocation is gone and not about to be adopted (a container taken back from its
        cgroup mark that kubelet's record did not give back): a registration of no
        allocation breaks the ledger's invariants, and without it the watchdog judges the
        container's GPU processes the same (unallocated)."""
        pending = self._allocator.awaiting_adoption()
        for registration in self.registrations():
            if procfs.read_start_ticks(registration.init_pid) != registration.init_start_ticks:
                self.release(
                    registration.container_id, "its init process is gone; no poststop came"
                )
            elif (
                registration.allocation_id not in pending
                and self._allocator.allocation(registration.allocation_id) is None
            ):
                self.release(
                    registration.container_id,
                    f"its allocation {registration.allocation_id} is gone",
                )


def _init_start_ticks(pid: int) -> tuple[int | None, str | None]:
    """(start time, None) or (None, why): unreadable is not admitted (fail closed)."""
    try:
        start_ticks = procfs.read_start_ticks(pid)
    except procfs.ProcfsError as e:
        return None, f"its init process {pid} cannot be read ({e})"
    if start_ticks is None:
        return None, f"its init process {pid} is gone"
    return start_ticks, None


def node_gpus(
    cards: Sequence[Card], mps_layout: MpsLayout | None, daemon_paths: DaemonPaths | None = None
) -> NodeGpus:
    nodes = tuple(
        CardNode(c.uuid, c.index, c.index if c.minor_number is None else c.minor_number)
        for c in cards
    )
    daemon_paths = daemon_paths or DaemonPaths()
    if mps_layout is None:
        return NodeGpus(nodes, daemon=daemon_paths)
    client_dirs = {c.uuid: mps_layout.client_dir(c.uuid) for c in nodes}
    shm_dirs = {c.uuid: mps_layout.shm_dir(c.uuid) for c in nodes}
    return NodeGpus(
        nodes, mps_layout.root, client_dirs, shm_dirs, mps_layout.retired_shm_dir, daemon_paths
    )
