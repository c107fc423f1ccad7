"""The DRA driver: NodePrepareResources is admission, NodeUnprepareResources is release.

Prepare, per claim kubelet names (docs/dra.md, "What prepare does"):

1. read the ResourceClaim from the API server (``ClaimSource``) and check it is the
   one kubelet means (its UID);
2. judge the allocation kube-scheduler wrote (``nodemgr.domain.claims``: device,
   ``consumedCapacity``, ``shareID``) and record it in the one ledger against
   everything it holds, device plugin allocations included
   (``ClaimLedger.admit_claim``), before answering;
3. write the claim's CDI spec with the env and mounts Allocate gives
   (``ClaimLedger.container_edits``, the same function) and answer its CDI ids.

A claim that fails any step gets its own error in the answer (kubelet fails the pod's
start and asks again later) and leaves nothing recorded: a CDI spec that cannot be
written releases the allocation the same call made. Asked again for a claim it holds,
it answers the same devices (kubelet restarts, retries of claims it left out). When a
batch outlasts kubelet's deadline, the claims not reached are left out of the answer:
kubelet asks for them again.

Unprepare releases the allocation and removes the spec; a claim it does not hold is
a success (kubelet may ask twice, and the claim object may be gone).

Calls are serialised (one lock): kubelet may call for two pods at once, and a claim
must be judged against the ledger as the previous one left it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from nodemgr.allocation.claims import ClaimLedger
from nodemgr.domain import cdi
from nodemgr.domain.claims import (
    ClaimDemand,
    DeviceCard,
    base_request,
    claim_demand,
    device_cards,
    device_name,
)
from nodemgr.domain.model import Allocation
from nodemgr.dra.cdifiles import CdiDirectory
from nodemgr.errors import (
    AllocationError,
    CdiError,
    GpushareError,
    KubeApiError,
    KubeNotFound,
    LedgerError,
)
from nodemgr.inventory import Card

log = logging.getLogger(__name__)

# (seconds, ok) for each NodePrepareResources call; ok is False when a claim was refused.
ObservePrepare = Callable[[float, bool], None]


@dataclass(frozen=True)
class ClaimKey:
    """A claim as kubelet names it in NodePrepareResources/NodeUnprepareResources."""

    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        return f"claim {self.namespace}/{self.name}"


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim, as kubelet records it (its ``Device`` message)."""

    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None


@dataclass(frozen=True)
class Prepared:
    """A claim's entry in the answer: its devices, or the error kubelet shows."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str | None = None


def node_devices(cards: Sequence[Card]) -> dict[str, DeviceCard]:
    """This node's DRA devices by name, one per card; ValueError when a card cannot be one."""
    return device_cards(
        [DeviceCard(device_name(c.uuid), c.uuid, c.index, c.memory_mib) for c in cards]
    )


class ClaimSource(Protocol):
    """Reads a ResourceClaim from the API server (the Kubernetes adapter)."""

    def read_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        """The claim as JSON; KubeNotFound when there is none, another KubeApiError when
        the API server cannot say."""
        ...


class ClaimReports(Protocol):
    """Where refusals go besides kubelet's answer: Events on the claim's pods."""

    def refused(self, claim: Mapping[str, Any] | None, key: ClaimKey, message: str) -> None: ...


class DraDriver:
    def __init__(
        self,
        *,
        driver: str,
        pool: str,
        ledger: ClaimLedger,
        cards: Sequence[Card],
        unit_mib: int,
        claims: ClaimSource | None,
        cdi_directory: CdiDirectory,
        reports: ClaimReports | None = None,
        observe_prepare: ObservePrepare | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``claims`` None: no API server to read claims from (every prepare is refused,
        saying so). ValueError when a card cannot be named as a DRA device."""
        self.driver = driver
        self.pool = pool
        self._ledger = ledger
        self._devices = node_devices(cards)
        self._unit_mib = unit_mib
        self._claims = claims
        self._cdi = cdi_directory
        self._reports = reports
        self._observe = observe_prepare
        self._clock = clock
        self._lock = threading.Lock()

    @property
    def devices(self) -> Mapping[str, DeviceCard]:
        """Device name -> card: what this node's ResourceSlice offers."""
        return self._devices

    # --- start ----------------------------------------------------------------------

    def restore(self) -> None:
        """At start: every claim the ledger holds gets its CDI spec written again (the
        directory may be a tmpfs emptied by a reboot), and specs of claims it no longer
        holds (a crash between release and removal) are removed."""
        with self._lock:
            live = set()
            for allocation in self._ledger.claim_allocations():
                assert allocation.claim is not None
                live.add(allocation.claim.uid)
                try:
                    self._cdi.write(allocation.claim.uid, self._spec(allocation))
                except (CdiError, OSError) as e:
                    log.error("cannot write the CDI spec of %s: %s", allocation.claim, e)
            self._cdi.remove_stale(live)

    # --- prepare --------------------------------------------------------------------

    def prepare(
        self, claims: Sequence[ClaimKey], deadline: float | None = None
    ) -> dict[str, Prepared]:
        """Claim UID -> its entry. The claims are read and judged one by one, then
        recorded together (one ledger transaction), then their CDI specs written. Claims
        not read by ``deadline`` (this driver's clock) are left out: kubelet asks for
        them again."""
        started = self._clock()
        answer: dict[str, Prepared] = {}
        with self._lock:
            judged: list[tuple[ClaimKey, Mapping[str, Any], ClaimDemand]] = []
            for key in claims:
                if deadline is not None and self._clock() >= deadline:
                    left = len({k.uid for k in claims} - set(answer) - {k.uid for k, *_ in judged})
                    log.warning(
                        "NodePrepareResources: %d claim(s) left out at kubelet's deadline", left
                    )
                    break
                found = self._judged(key)
                if isinstance(found, Prepared):
                    answer[key.uid] = found
                else:
                    judged.append((key, *found))
            admitted = self._ledger.admit_claims([demand for _, _, demand in judged])
            for (key, claim, _), outcome in zip(judged, admitted, strict=True):
                answer[key.uid] = self._written(key, claim, outcome)
        self._observed(self._clock() - started, all(e.error is None for e in answer.values()))
        return answer

    def _judged(self, key: ClaimKey) -> Prepared | tuple[Mapping[str, Any], ClaimDemand]:
        """The claim read and its demand on this node; a refusal (Prepared with an error)."""
        if self._claims is None:
            return self._refused(
                None,
                key,
                f"{key} cannot be read: gpushare-node has no Kubernetes API (kubernetes "
                "credentials missing or unusable; see its log)",
            )
        try:
            claim = self._claims.read_claim(key.namespace, key.name)
        except KubeNotFound:
            return self._refused(None, key, f"{key} (UID {key.uid}) is not in the API server")
        except KubeApiError as e:
            return Prepared(error=f"cannot read {key} from the API server: {e}")
        try:
            demand = claim_demand(
                claim,
                uid=key.uid,
                driver=self.driver,
                pool=self.pool,
                devices=self._devices,
                unit_mib=self._unit_mib,
            )
        except AllocationError as e:
            return self._refused(claim, key, str(e))
        return claim, demand

    def _written(
        self,
        key: ClaimKey,
        claim: Mapping[str, Any],
        outcome: tuple[Allocation, bool] | GpushareError,
    ) -> Prepared:
        """The claim's entry once the ledger answered: its CDI spec written (the allocation
        released again if it cannot be), or the refusal."""
        if isinstance(outcome, AllocationError):
            return self._refused(claim, key, str(outcome))
        if isinstance(outcome, GpushareError):  # the ledger could not be written
            return Prepared(error=f"{key} was not recorded: {outcome}")
        allocation, new = outcome
        try:
            self._cdi.write(key.uid, self._spec(allocation))
        except (CdiError, OSError) as e:
            why = f"{key}: its CDI spec cannot be written in {self._cdi.path}: {e}"
            if new:
                self._release_quietly(key)
            return self._refused(claim, key, why)
        return Prepared(devices=self._devices_of(allocation))

    def _spec(self, allocation: Allocation) -> dict[str, Any]:
        claim = allocation.claim
        assert claim is not None
        envs, mounts = self._ledger.container_edits(allocation)
        devices = [cdi.ClaimDevice(r.device, r.share_id, envs, mounts) for r in claim.results]
        return cdi.claim_spec(self.driver, claim.uid, devices)

    def _devices_of(self, allocation: Allocation) -> tuple[PreparedDevice, ...]:
        claim = allocation.claim
        assert claim is not None
        kind = cdi.kind(self.driver)
        return tuple(
            PreparedDevice(
                request_names=(base_request(r.request),),
                pool=r.pool,
                device=r.device,
                cdi_ids=(cdi.qualified_id(kind, cdi.device_name(claim.uid, r.device, r.share_id)),),
                share_id=r.share_id,
            )
            for r in claim.results
        )

    def _release_quietly(self, key: ClaimKey) -> None:
        try:
            self._ledger.release_claim(key.uid)
        except LedgerError as e:  # kept: kubelet's unprepare (or the next prepare) ends it
            log.error("could not release the allocation of %s after a failure: %s", key, e)

    def _refused(self, claim: Mapping[str, Any] | None, key: ClaimKey, message: str) -> Prepared:
        log.warning("NodePrepareResources refused %s: %s", key, message)
        if self._reports is not None:
            try:
                self._reports.refused(claim, key, message)
            except Exception:  # telling the pod must never change kubelet's answer
                log.exception("reporting a refused claim failed")
        return Prepared(error=message)

    def _observed(self, seconds: float, ok: bool) -> None:
        if self._observe is None:
            return
        try:
            self._observe(seconds, ok)
        except Exception:  # a metrics bug must not turn an answer into an error
            log.exception("observing NodePrepareResources failed")

    # --- unprepare ------------------------------------------------------------------

    def unprepare(self, claims: Sequence[ClaimKey]) -> dict[str, str | None]:
        """Claim UID -> None (released, or never held) or the error kubelet retries on."""
        answer: dict[str, str | None] = {}
        with self._lock:
            for key in claims:
                try:
                    self._ledger.release_claim(key.uid)
                except LedgerError as e:
                    answer[key.uid] = f"{key} was not released: {e}"
                    continue
                try:
                    self._cdi.remove(key.uid)
                except (OSError, CdiError) as e:
                    answer[key.uid] = f"{key}: its CDI spec cannot be removed: {e}"
                    continue
                answer[key.uid] = None
        return answer
