"""``nodemgr``: the operator's command line.

``install``/``uninstall`` and ``mps-start`` change the node; every other command only
reads. Besides the commands in modules of their own, this one has:
- ``nodemgr check-config [--config FILE]``: validate a config file (exit 2 if bad);
- ``nodemgr check-ledger [--config FILE] [--json]``: the ledger's invariants (cli/check_ledger.py);
- ``nodemgr allocations [--config FILE] [--json]``: the ledger's allocations and
  the containers the runtime hook registered on each;
- ``nodemgr violations [--config FILE] [--json] [--limit N]``: the watchdog's
  history of quota violations, newest first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from nodemgr.allocation.ledger import LEDGER_FILE, Ledger
from nodemgr.cli import check_ledger, mps_start
from nodemgr.cli import status as status_cli
from nodemgr.cli.doctor import command as doctor
from nodemgr.cli.install import command as install
from nodemgr.common.version import package_version
from nodemgr.config.loading import CONFIG_HELP, config_error_line, load_settings
from nodemgr.errors import ConfigError, LedgerError

# Each module's ``add_parser(sub)`` sets ``run`` (args -> exit code) as the default.
_COMMAND_MODULES: tuple = (status_cli, doctor, install, check_ledger, mps_start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nodemgr", description="gpushare-node operator tool")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in _COMMAND_MODULES:
        module.add_parser(sub)
    check = sub.add_parser("check-config", help="validate the daemon's configuration file")
    check.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    allocs = sub.add_parser("allocations", help="list the allocations in the ledger")
    allocs.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    allocs.add_argument("--json", action="store_true", help="machine-readable output")
    history = sub.add_parser("violations", help="the history of quota violations")
    history.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    history.add_argument("--json", action="store_true", help="machine-readable output")
    history.add_argument("--limit", type=int, default=50, help="newest N rows (default 50)")
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is not None:
        return args.run(args)
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(config_error_line(e), file=sys.stderr)
        return 2
    if args.command == "check-config":
        print(
            f"{args.config or '(defaults)'}: ok (node {settings.node_name}, "
            f"GPU backend {settings.gpus.backend})"
        )
        return 0
    try:
        ledger = _open_ledger(settings.state_dir)
        try:
            if args.command == "violations":
                return _violations(ledger, args.json, args.limit)
            return _allocations(ledger, args.json)
        finally:
            ledger.close()
    except LedgerError as e:
        print(f"nodemgr: {e}", file=sys.stderr)
        return 1


def _open_ledger(state_dir: str) -> Ledger:
    if not os.path.exists(os.path.join(state_dir, LEDGER_FILE)):
        raise LedgerError(
            f"no ledger in {state_dir}: gpushare-node has not run here with this state_dir"
        )
    return Ledger(state_dir, read_only=True)


def _allocations(ledger: Ledger, as_json: bool) -> int:
    allocations = ledger.load()
    containers: dict[str, list[str]] = {}
    for registration in ledger.load_registrations():
        containers.setdefault(registration.allocation_id, []).append(registration.container_id)
    rows: list[dict[str, Any]] = [
        {
            "id": a.id,
            "cards": list(a.cards),
            "whole": a.whole,
            "memory_mib": a.memory_mib,
            "core_percent": a.core_percent,
            "namespace": a.owner.namespace if a.owner else None,
            "pod": a.owner.pod if a.owner else None,
            "container": a.owner.container if a.owner else None,
            # The UID of the owner's pod, where the pod cache knew it at Allocate.
            "pod_uid": a.owner_uid,
            "created_at": a.created_at,
            "confirmed_by_kubelet": a.confirmed_at is not None,
            "containers": containers.get(a.id, []),
            # The DRA claim it was made for (docs/dra.md); None: a device plugin allocation.
            "claim": None
            if a.claim is None
            else {"namespace": a.claim.namespace, "name": a.claim.name, "uid": a.claim.uid},
        }
        for a in allocations
    ]
    if as_json:
        print(json.dumps({"allocations": rows}, indent=2))
        return 0
    print(f"{'ID':<20} {'CARD':<44} {'MEMORY':>8} {'CORE':>5}  {'OWNER':<40} AGE")
    for row in rows:
        owner = (
            f"{row['namespace']}/{row['pod']}/{row['container']}" if row["pod"] else "(unconfirmed)"
        )
        if row["claim"] is not None:
            owner = f"claim {row['claim']['namespace']}/{row['claim']['name']}"
        memory = "whole" if row["whole"] else f"{row['memory_mib']}M"
        core = "" if row["whole"] else f"{row['core_percent']}%"
        age = f"{int(time.time() - row['created_at'])}s"
        print(
            f"{row['id']:<20} {','.join(row['cards']):<44} {memory:>8} {core:>5}  {owner:<40} {age}"
        )
    return 0


def _violations(ledger: Ledger, as_json: bool, limit: int) -> int:
    rows = ledger.violations(limit)
    if as_json:
        print(json.dumps({"violations": rows}, indent=2))
        return 0
    if not rows:
        print("no violations recorded")
        return 0
    for row in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["at"]))
        who = f"{row['namespace']}/{row['pod']}/{row['container']}" if row["pod"] else "-"
        print(
            f"{when}  {row['kind']:<11} {row['action']:<4}  {who}  container "
            f"{row['container_id'] or '-'}  {row['card']}: {row['detail']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
