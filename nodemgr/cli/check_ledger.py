"""``nodemgr check-ledger [--config FILE] [--json]``: are the ledger's invariants intact?

No device held twice, every card within its memory and share, shared
allocations on one card with a consistent limit, no container registered to a
freed allocation (``nodemgr.domain.invariants``). Read-only: safe while the
daemon runs. Exit status: 0 sound, 1 broken (each problem on its own line) or
no ledger, 2 bad config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from nodemgr.allocation.audit import LedgerAudit, audit_ledger, card_capacities
from nodemgr.allocation.ledger import LEDGER_FILE
from nodemgr.config.loading import CONFIG_HELP, config_error_line, load_settings
from nodemgr.errors import ConfigError, LedgerError


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("check-ledger", help="check the ledger's invariants (read-only)")
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(config_error_line(e), file=sys.stderr)
        return 2
    if not os.path.exists(os.path.join(settings.state_dir, LEDGER_FILE)):
        print(f"nodemgr: no ledger in {settings.state_dir}", file=sys.stderr)
        return 1
    cards, why = card_capacities(settings)
    try:
        audit = audit_ledger(settings.state_dir, settings.resources.memory_unit_mib, cards)
    except LedgerError as e:
        print(f"nodemgr: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(_document(audit, why), indent=2))
    else:
        _print(audit, why)
    return 1 if audit.problems else 0


def _document(audit: LedgerAudit, why: str | None) -> dict[str, object]:
    return {
        "ledger": audit.path,
        "sound": not audit.problems,
        "allocations": audit.allocations,
        "containers": audit.containers,
        "capacities_checked": audit.capacities_checked,
        "capacities_unchecked_because": why,
        "problems": audit.problems,
    }


def _print(audit: LedgerAudit, why: str | None) -> None:
    verdict = "sound" if not audit.problems else f"{len(audit.problems)} problem(s)"
    print(
        f"{audit.path}: {verdict} ({audit.allocations} allocation(s), "
        f"{audit.containers} registered container(s))"
    )
    if why is not None:
        print(f"  card capacities not checked: {why}")
    for problem in audit.problems:
        print(f"  - {problem}")
