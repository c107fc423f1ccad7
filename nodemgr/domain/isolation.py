"""How far this node really isolates one allocation, in words an admin can act on (pure).

From the allocation and what the node has right now (the watchdog, the card's MPS
state and ceiling, a kernel dmem region), a level and a one-line reason for memory and
for compute, shown by ``nodemgr status``, the metrics and the pod annotation.

Memory levels (strongest first):

- ``exclusive``: a whole card, given to this container alone;
- ``enforced``: the watchdog adds up the container's GPU processes every scan
  and kills the newest above quota + ``enforcement.grace_mib``. It does not
  depend on the container's env, so a hostile container is bounded too, after
  at most one scan;
- ``watched``: the same check, but ``enforcement.action: log`` kills nothing;
- ``advisory``: the watchdog cannot judge (down, or per-process GPU memory
  unreadable): only the client's env bounds it, and a process can drop that;
- ``unlimited``: no memory quota was asked (share only): it may take the card's
  free memory.

Compute levels:

- ``exclusive``: whole card(s);
- ``advisory``: MPS applies ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` from the
  client's env. The watchdog reads ``/proc/PID/environ``, which is the live
  environ memory of the process: the process can rewrite it after exec, so a
  raised percentage is invisible, and MPS before the r615 namespaces has no
  per-client ceiling for it;
- ``unlimited``: no share was asked, or MPS does not run on the card (disabled,
  down, ...): nothing caps its SMs.

There is no ``hard`` memory level: a kernel dmem region for the card (cgroup v2
``dmem`` controller and a driver registering the card) would allow one, but
gpushare-node does not write ``dmem.max`` into container cgroups, so the
reason only says the region exists and is unused.

JSON (``Isolation.as_json``; keys are a contract: extended, never renamed):
``{"memory", "memory_detail", "compute", "compute_detail"}``, all strings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

EXCLUSIVE = "exclusive"
ENFORCED = "enforced"
WATCHED = "watched"
ADVISORY = "advisory"
UNLIMITED = "unlimited"

MEMORY_LEVELS = (EXCLUSIVE, ENFORCED, WATCHED, ADVISORY, UNLIMITED)
COMPUTE_LEVELS = (EXCLUSIVE, ADVISORY, UNLIMITED)


@dataclass(frozen=True)
class WatchdogFacts:
    running: bool
    action: str | None  # enforcement.action: "kill" or "log"; None when unknown
    usage_readable: bool  # its last scan read per-process GPU memory (NVML or usage file)


@dataclass(frozen=True)
class CardIsolationFacts:
    mps_state: str  # MpsView.state: healthy, down, hung, ..., "disabled" (mps.enabled false)
    # The supervisor set the server-side pinned memory ceiling (failing is a card problem).
    ceiling_set: bool
    dmem_region: str | None = None


@dataclass(frozen=True)
class NodeIsolationFacts:
    watchdog: WatchdogFacts
    dmem_regions: Mapping[str, str] = field(default_factory=dict)  # card UUID -> region


@dataclass(frozen=True)
class Isolation:
    memory: str  # one of MEMORY_LEVELS
    memory_detail: str
    compute: str  # one of COMPUTE_LEVELS
    compute_detail: str

    def as_json(self) -> dict[str, str]:
        return {
            "memory": self.memory,
            "memory_detail": self.memory_detail,
            "compute": self.compute,
            "compute_detail": self.compute_detail,
        }


def isolation_of(
    *,
    whole: bool,
    memory_mib: int,
    core_percent: int,
    card: CardIsolationFacts,
    watchdog: WatchdogFacts,
) -> Isolation:
    """The isolation of one allocation on ``card`` (its first card when whole). Reasons
    name no amounts, so allocations in the same situation share them."""
    if whole:
        return Isolation(
            EXCLUSIVE,
            "whole card: no other allocation shares its memory",
            EXCLUSIVE,
            "whole card: all its SMs, no MPS",
        )
    memory, memory_detail = _memory(memory_mib, card, watchdog)
    compute, compute_detail = _compute(core_percent, card)
    return Isolation(memory, memory_detail, compute, compute_detail)


def _memory(memory_mib: int, card: CardIsolationFacts, watchdog: WatchdogFacts) -> tuple[str, str]:
    mps = _mps_memory(card)
    if not memory_mib:
        return UNLIMITED, f"no memory quota asked: it may take the card's free memory; {mps}"
    judging = "the watchdog adds up the container's GPU processes at every scan"
    if not watchdog.running:
        level, why = ADVISORY, "the watchdog is down: nothing checks the quota"
    elif not watchdog.usage_readable:
        level, why = (
            ADVISORY,
            "per-process GPU memory cannot be read (no scan yet, or NVML failing): the "
            "watchdog cannot check the quota",
        )
    elif watchdog.action == "kill":
        level, why = ENFORCED, f"{judging} and kills the newest above quota + enforcement.grace_mib"
    elif watchdog.action == "log":
        level, why = (
            WATCHED,
            f"{judging} and reports use above quota + enforcement.grace_mib, killing nothing "
            "(enforcement.action: log)",
        )
    else:  # an action this code does not know: claim nothing
        level, why = (
            ADVISORY,
            f"enforcement action {watchdog.action!r} is not known to kill: nothing checks "
            "the quota",
        )
    return level, f"{why}; {mps}{_dmem(card)}"


def _mps_memory(card: CardIsolationFacts) -> str:
    if card.mps_state == "disabled":
        return "no MPS (mps.enabled false): no per-process limit between scans"
    if card.mps_state != "healthy":
        return f"MPS is {card.mps_state}: no per-process limit between scans"
    if not card.ceiling_set:
        return (
            "MPS answers but the card has a problem (or its health is not known): its "
            "server-side ceiling may not be set"
        )
    return (
        "MPS caps each process at the pinned limit of its env (which a process can drop) "
        "and at the card's shareable memory"
    )


def _dmem(card: CardIsolationFacts) -> str:
    if card.dmem_region is None:
        return ""
    return (
        f"; the kernel dmem region {card.dmem_region} exists but gpushare-node sets no "
        "dmem.max: no hard limit"
    )


def _compute(core_percent: int, card: CardIsolationFacts) -> tuple[str, str]:
    if not core_percent:
        return UNLIMITED, "no compute share asked: it competes for all of the card's SMs"
    if card.mps_state == "disabled":
        return UNLIMITED, ("share not applied: no MPS (mps.enabled false), it may use all SMs")
    if card.mps_state != "healthy":
        return UNLIMITED, (f"share not applied while MPS is {card.mps_state}: it may use all SMs")
    return ADVISORY, (
        "MPS applies the share from the client's env "
        "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE); a process can rewrite its live environ after "
        "exec, so a raised share goes unseen, and MPS before r615 has no per-client ceiling"
    )
