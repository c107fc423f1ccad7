"""The containers the runtime hook let start, and the hook's decisions.

``ContainerRegistry.admit`` is what the hook socket calls at a container's
creation: it checks the container's GPU env against its live allocation
(:mod:`nodemgr.domain.containercheck`) and, when it matches, registers the
container's cgroup in the ledger, so the watchdog can tell whose GPU process
is whose, also after a daemon restart. ``release`` is the poststop side.

An allocation id is not a bearer token: a GPU container must be tied to the
allocation by its pod (:mod:`nodemgr.domain.podtie`). One whose runtime gave
no pod identity (no CRI annotations) is refused. Given ``kubelet_record``
(kubelet's PodResources List), ``admit`` asks kubelet at the moment of the
call which containers hold the allocation's devices and admits only a
container of that pod. The ledger learns that a pod is gone only at the next
reconcile; kubelet's record knows at once, so a freed allocation is refused
then too (and a reconcile asked for, which releases it). Every GPU container
is refused while kubelet cannot answer: kubelet creates every pod's
containers, so while it is down no pod container is being made anyway, and an
allocation nobody can vouch for grants nothing (fail closed).

What it must not do: parse the wire protocol (the hook server does) or act
on running processes (the watchdog does).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hooks import gpuenv
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.domain.containercheck import (
    CgroupError,
    check_container,
    container_cgroup,
    identity_conflict,
)
from nodemgr.domain.model import Allocation, ContainerRef, Registration
from nodemgr.domain.podtie import NO_IDENTITY, KubeletRecord, holders, pod_of, pod_tie_problem
from nodemgr.enforcement import procfs
from nodemgr.errors import GpushareError, LedgerError

log = logging.getLogger(__name__)


class ContainerRegistry:
    def __init__(
        self,
        ledger: Ledger,
        allocator: Allocator,
        mps_pipe_directory: str | None,
        clock: Callable[[], float] = time.time,
        kubelet_record: Callable[[], KubeletRecord] | None = None,
    ):
        """``kubelet_record``: kubelet's PodResources List (raises a GpushareError when
        kubelet does not answer); None trusts the ledger alone (tests, no kubelet)."""
        self._ledger = ledger
        self._allocator = allocator
        self._mps_pipe_directory = mps_pipe_directory
        self._clock = clock
        self._kubelet_record = kubelet_record
        self._card_uuids_by_index = {str(card.index): card.uuid for card in allocator.cards}
        self._lock = threading.Lock()
        self._registrations = {r.container_id: r for r in ledger.load_registrations()}

    def admit(
        self,
        container_id: str,
        pid: int,
        env: dict[str, str],
        identity: ContainerRef | None,
        cgroup_text: str,
    ) -> tuple[bool, str]:
        """(allowed, message): whether the container may start; registers it if so."""
        who = f"container {container_id}" + (f" ({identity})" if identity else "")
        if not gpuenv.needs_daemon(env):
            return True, f"{who} asks for no GPU"
        allocation_id = env.get(gpuenv.ALLOCATION_ID)
        allocation = self._allocator.allocation(allocation_id) if allocation_id else None
        problem = check_container(
            env, allocation, self._card_uuids_by_index, self._mps_pipe_directory
        )
        if problem is None and allocation is not None and gpuenv.requested_gpus(env) is None:
            return True, f"{who} holds allocation {allocation.id} but asks for no GPU"
        if problem is None and allocation is not None:
            problem = self._tie_problem(identity, allocation)  # outside the lock: a local RPC
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
                try:
                    start_ticks = procfs.read_start_ticks(pid)
                except procfs.ProcfsError as e:  # fail closed: unreadable is not admitted
                    problem = f"its init process {pid} cannot be read ({e})"
            if problem is None and start_ticks is None:
                problem = f"its init process {pid} is gone"
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
        log.info(
            "registered %s on allocation %s (%s), cgroup %s",
            who,
            allocation.id,
            ", ".join(allocation.cards),
            cgroup,
        )
        return True, f"{who} registered on allocation {allocation.id}"

    def _tie_problem(self, identity: ContainerRef | None, allocation: Allocation) -> str | None:
        """Why the container is not tied to the allocation by its pod
        (:mod:`nodemgr.domain.podtie`), kubelet's record read now; or None."""
        if identity is None:
            return NO_IDENTITY
        if self._kubelet_record is None:
            return None  # no kubelet to ask (tests): identity_conflict alone binds it
        try:
            record = self._kubelet_record()
        except GpushareError as e:
            return (
                f"cannot ask kubelet whether allocation {allocation.id} is still held ({e}); "
                "GPU containers start again once kubelet answers"
            )
        holding = holders(allocation, record, self._allocator.resource_names)
        if not holding or len({pod_of(ref) for ref in holding}) > 1:
            self._allocator.reconcile_requested.set()  # the run loop releases or splits it now
        if not holding:
            return (
                f"kubelet no longer reports allocation {allocation.id} "
                f"({', '.join(allocation.cards)}) for any container: its pod is gone "
                "(or was refused), so the allocation grants nothing"
            )
        return pod_tie_problem(identity, allocation, holding)

    def release(self, container_id: str, why: str = "stopped") -> bool:
        """Forget a container; False if it was not registered."""
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
        """Drop containers whose init process is gone without a poststop."""
        for registration in self.registrations():
            if procfs.read_start_ticks(registration.init_pid) != registration.init_start_ticks:
                self.release(
                    registration.container_id, "its init process is gone; no poststop came"
                )
