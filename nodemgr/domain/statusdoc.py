"""The status document: every card and allocation of the node at a glance (pure).

The status socket serves it, ``nodemgr status --json`` prints it, the metrics export it
and ``render_table`` shows it. With the daemon down, ``nodemgr status`` builds it from
the ledger (``source: "ledger"``: health, usage and MPS state null).

Document (JSON keys are a public contract: extend, never rename)::

    {"node", "source": "daemon"|"ledger", "daemon": {...}|null,
     "gpus": [{"index", "uuid", "model", "mode": "shared"|"whole"|"idle",
               "memory_total_mib", "memory_allocated_mib", "memory_used_mib"|null,
               "core_allocated_percent", "healthy"|null, "problem"|null,
               "mps": {"state", "clients"|null, "detail"}, "allocations"}],
     "allocations": [{"id", "gpu", "gpu_index", "gpus", "whole", "memory_mib",
                      "memory_used_mib"|null, "core_percent", "namespace", "pod",
                      "container", "state": "confirmed"|"pending", "containers",
                      "violations", "created_at",
                      "isolation": {"memory", "memory_detail", "compute",
                                    "compute_detail"}|null,
                      "claim": {"namespace", "name", "uid"}|null}],
     "enforcement": {"action", "violations": {kind: count}, "kills",
                     "unreadable_processes", "judging", "problem"|null,
                     "failed_scans"}|null}

``daemon`` (from the status socket) carries ``pid``, ``version``, ``started_at``,
``uptime_seconds``, ``ready``, ``registered``, ``metrics_address``, ``healthy``
(false while a background worker is down or cannot do its job), ``problems``
(why not healthy, one line each), ``workers`` ({name: {"up", "restarts",
"failure", "problem"}}) and ``listeners`` ({name: {"connections"|null,
"max_connections", "deadline_seconds"|null, "refused": {reason: count}}}).

``claim`` names the DRA ResourceClaim an allocation was made for (null: a device
plugin allocation, whose owner is namespace/pod/container); ``daemon.dra`` is the
DRA plugin's state (``driver``, ``serving``, ``registered``, ``registration_error``;
absent with ``dra.enabled`` false).

``isolation``: nodemgr.domain.isolation (null from the ledger). None (null) always
means "not known", never zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hooks.textsafe import quote
from nodemgr.domain.isolation import CardIsolationFacts, NodeIsolationFacts, isolation_of
from nodemgr.domain.model import Allocation

SCHEMA_VERSION = 1


class CardFacts(Protocol):
    """nodemgr.inventory.Card (read-only properties, so a frozen dataclass satisfies it)."""

    @property
    def index(self) -> int: ...
    @property
    def uuid(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def memory_mib(self) -> int: ...


@dataclass(frozen=True)
class MpsView:
    state: str  # healthy, down, hung, broken, fault, starting, off (card given out whole)
    clients: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class UsageView:
    """GPU memory really used, from the watchdog's last scan."""

    card_used_mib: Mapping[str, int]  # by card UUID
    allocation_used_mib: Mapping[str, int]  # by allocation ID


MPS_DISABLED = MpsView("disabled", None, "mps.enabled is false: env quotas only")
MPS_UNKNOWN = MpsView("unknown", None, "gpushare-node is not running")


def build_status(
    node: str,
    cards: Sequence[CardFacts],
    allocations: Iterable[Allocation],
    *,
    source: str,
    card_problems: Mapping[str, str] | None,
    mps: Mapping[str, MpsView] | None,
    usage: UsageView | None,
    containers: Mapping[str, int],
    violations: Mapping[str, int],
    enforcement: dict[str, Any] | None,
    daemon: dict[str, Any] | None,
    isolation: NodeIsolationFacts | None = None,
) -> dict[str, Any]:
    """The status document. ``card_problems`` None = health unknown (daemon down);
    ``mps`` None = MPS disabled; a card missing from ``mps`` is shown as unknown;
    ``isolation`` None = not known (daemon down): each allocation's is null."""
    allocations = list(allocations)
    index_of = {card.uuid: card.index for card in cards}
    memory_of = {card.uuid: card.memory_mib for card in cards}
    mps_views = {card.uuid: _mps_view(mps, card.uuid) for card in cards}
    gpus = []
    for card in sorted(cards, key=lambda c: c.index):
        on_card = [a for a in allocations if card.uuid in a.cards]
        whole = any(a.whole for a in on_card)
        mode = "whole" if whole else "shared" if on_card else "idle"
        mps_view = mps_views[card.uuid]
        problem = None if card_problems is None else card_problems.get(card.uuid)
        gpus.append(
            {
                "index": card.index,
                "uuid": card.uuid,
                "model": card.name,
                "mode": mode,
                "memory_total_mib": card.memory_mib,
                "memory_allocated_mib": card.memory_mib
                if whole
                else sum(a.memory_mib for a in on_card),
                "memory_used_mib": None if usage is None else usage.card_used_mib.get(card.uuid, 0),
                "core_allocated_percent": 100 if whole else sum(a.core_percent for a in on_card),
                "healthy": None if card_problems is None else problem is None,
                "problem": problem,
                "mps": {
                    "state": mps_view.state,
                    "clients": mps_view.clients,
                    "detail": mps_view.detail,
                },
                "allocations": len(on_card),
            }
        )
    rows = []
    for a in allocations:
        first_card = a.cards[0] if a.cards else ""
        rows.append(
            {
                "id": a.id,
                "gpu": first_card,
                "gpu_index": index_of.get(first_card),
                "gpus": list(a.cards),
                "whole": a.whole,
                "memory_mib": sum(memory_of.get(c, 0) for c in a.cards)
                if a.whole
                else a.memory_mib,
                "memory_used_mib": None
                if usage is None
                else usage.allocation_used_mib.get(a.id, 0),
                "core_percent": 100 * len(a.cards) if a.whole else a.core_percent,
                "namespace": a.owner.namespace if a.owner else None,
                "pod": a.owner.pod if a.owner else None,
                "container": a.owner.container if a.owner else None,
                "state": "confirmed" if a.confirmed_at is not None else "pending",
                "containers": containers.get(a.id, 0),
                "violations": violations.get(a.id, 0),
                "created_at": a.created_at,
                "isolation": _isolation(a, first_card, mps_views, card_problems, isolation),
                "claim": None
                if a.claim is None
                else {"namespace": a.claim.namespace, "name": a.claim.name, "uid": a.claim.uid},
            }
        )
    return {
        "schema": SCHEMA_VERSION,
        "node": node,
        "source": source,
        "daemon": daemon,
        "gpus": gpus,
        "allocations": rows,
        "enforcement": enforcement,
    }


def _mps_view(mps: Mapping[str, MpsView] | None, uuid: str) -> MpsView:
    return MPS_DISABLED if mps is None else mps.get(uuid, MPS_UNKNOWN)


def _isolation(
    allocation: Allocation,
    card: str,
    mps_views: Mapping[str, MpsView],
    card_problems: Mapping[str, str] | None,
    node: NodeIsolationFacts | None,
) -> dict[str, str] | None:
    """The allocation's isolation as JSON; None when the node's facts are not known."""
    if node is None:
        return None
    state = mps_views.get(card, MPS_UNKNOWN).state
    # The supervisor makes a card whose ceiling it could not set a card problem.
    ceiling_set = (
        state == "healthy" and card_problems is not None and card_problems.get(card) is None
    )
    facts = CardIsolationFacts(state, ceiling_set, node.dmem_regions.get(card))
    return isolation_of(
        whole=allocation.whole,
        memory_mib=allocation.memory_mib,
        core_percent=allocation.core_percent,
        card=facts,
        watchdog=node.watchdog,
    ).as_json()


# --- the table a person reads -------------------------------------------------------------


def render_table(status: dict[str, Any], now: float) -> str:
    """``nodemgr status`` without --json: a header, one row per card, one per allocation."""
    lines = [_header(status, now), ""]
    cards = [
        (
            "GPU",
            "MODEL",
            "MODE",
            "MEMORY ALLOC/USED/TOTAL",
            "CORE",
            "MPS",
            "CLIENTS",
            "PODS",
            "HEALTH",
        )
    ]
    for gpu in status["gpus"]:
        mps = gpu["mps"]
        cards.append(
            (
                str(gpu["index"]),
                gpu["model"],
                gpu["mode"],
                f"{_gib(gpu['memory_allocated_mib'])} / {_gib(gpu['memory_used_mib'])} / "
                f"{_gib(gpu['memory_total_mib'])}",
                f"{gpu['core_allocated_percent']}%",
                mps["state"],
                _known(mps["clients"]),
                str(gpu["allocations"]),
                "?" if gpu["healthy"] is None else "ok" if gpu["healthy"] else gpu["problem"],
            )
        )
    lines += _columns(cards)
    lines.append("")
    if not status["allocations"]:
        lines.append("no allocations")
        return "\n".join(lines)
    rows = [
        (
            "POD",
            "CONTAINER",
            "GPU",
            "MEMORY QUOTA/USED",
            "CORE",
            "ISOLATION MEM/CORE",
            "STATE",
            "CTRS",
            "VIOL",
            "AGE",
        )
    ]
    for a in status["allocations"]:
        pod = f"{a['namespace']}/{a['pod']}" if a["pod"] else "(not yet known)"
        claim = a.get("claim")
        if claim:  # a DRA claim: its pods are kubelet's to list (PodResources)
            pod = f"claim {claim['namespace']}/{claim['name']}"
        gpu = (
            ",".join(str(i) for i in _indexes(status, a)) if a["whole"] else _known(a["gpu_index"])
        )
        rows.append(
            (
                pod,
                a["container"] or "-",
                gpu,
                "whole card"
                if a["whole"]
                else f"{_gib(a['memory_mib'])} / {_gib(a['memory_used_mib'])}",
                "-" if a["whole"] else f"{a['core_percent']}%",
                _levels(a.get("isolation")),
                a["state"],
                str(a["containers"]),
                str(a["violations"]),
                _age(now - a["created_at"]),
            )
        )
    lines += _columns(rows)
    lines += _isolation_reasons(status["allocations"])
    return "\n".join(lines)


def _levels(isolation: Mapping[str, str] | None) -> str:
    return "?" if isolation is None else f"{isolation['memory']}/{isolation['compute']}"


def _isolation_reasons(allocations: Sequence[Mapping[str, Any]]) -> list[str]:
    """Below the table, each isolation level shown once with its reason (whole cards aside)."""
    reasons: dict[str, None] = {}  # ordered, without repeats
    for a in allocations:
        isolation = a.get("isolation")
        if isolation is None or a["whole"]:
            continue
        for kind in ("memory", "compute"):
            reasons[f"{kind} {isolation[kind]}: {isolation[kind + '_detail']}"] = None
    if not reasons:
        return []
    return ["", "isolation (docs/isolation.md):", *(f"  {r}" for r in sorted(reasons))]


def _header(status: dict[str, Any], now: float) -> str:
    node = f"node {status['node']}"
    daemon = status["daemon"]
    if status["source"] != "daemon" or daemon is None:
        return (
            f"{node}: gpushare-node is NOT running; last state from the ledger "
            "(no health, usage or MPS state)"
        )
    if not daemon.get("registered"):
        state = "not registered with kubelet"
    elif not daemon.get("ready"):
        state = "registered, waiting for MPS"
    else:
        state = "ready"
    if daemon.get("healthy") is False:
        state = "NOT HEALTHY (" + "; ".join(daemon.get("problems") or ["unknown"]) + ")"
    head = (
        f"{node}: gpushare-node pid {daemon['pid']}, up {_age(now - daemon['started_at'])}, {state}"
    )
    enforcement = status.get("enforcement")
    if enforcement:
        count = sum(enforcement["violations"].values())
        head += (
            f"; enforcement {enforcement['action']}: {count} violations, "
            f"{enforcement['kills']} kills since start"
        )
    return head


def _indexes(status: dict[str, Any], allocation: dict[str, Any]) -> list[int]:
    index_of = {gpu["uuid"]: gpu["index"] for gpu in status["gpus"]}
    return [index_of[uuid] for uuid in allocation["gpus"] if uuid in index_of]


def _columns(rows: Sequence[tuple[str, ...]]) -> list[str]:
    """Aligned columns; a cell (a pod's name, a card's problem) that does not print as one
    plain line is shown as its escaped literal (:func:`hooks.textsafe.quote`)."""
    rows = [tuple(quote(cell, limit=10_000) if cell else cell for cell in row) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]  # fmt: skip


def _gib(mib: int | None) -> str:
    if mib is None:
        return "?"
    return f"{mib / 1024:.1f}G"


def _known(value: object) -> str:
    return "?" if value is None else str(value)


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
