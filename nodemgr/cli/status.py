"""``nodemgr status [--config FILE] [--json]``: every card and allocation at a glance.

With the daemon down it shows the ledger's last state, exiting 3 like ``systemctl
status`` of a stopped unit. It changes nothing. Exit codes: 0 daemon answered; 1 the
socket refused us (not root); 2 bad config; 3 daemon down. This module owns the whole
command line, ``--cluster``'s flags included (``cluster_status.run_cluster``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

from hooks.protocol import ProtocolError
from nodemgr.allocation.ledger import LEDGER_FILE, Ledger
from nodemgr.cli.cluster_status import run_cluster
from nodemgr.config.loading import CONFIG_HELP, config_error_line, load_settings
from nodemgr.config.schema import Settings
from nodemgr.domain.statusdoc import build_status, render_table
from nodemgr.errors import ConfigError, LedgerError
from nodemgr.status.server import CARDS_META_KEY, query

EXIT_DAEMON_DOWN = 3


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "status",
        help="every GPU and allocation of this node, from the running daemon (--cluster: "
        "of every node, from the Kubernetes API)",
        description="Per card: mode, memory allocated/used/total, core share, MPS state; "
        "per allocation: pod, container, card, quota and use, state, violations. With "
        "--cluster: every node's cards and pods as `kubectl inspect gpushare` shows them.",
    )
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="every node's GPUs from the Kubernetes API (the nodes' gpushare annotation), in "
        "the shape of `kubectl inspect gpushare`; needs RBAC nodes list, which gpushare-node's "
        "own ClusterRole does not grant: run it with an admin's kubeconfig",
    )
    parser.add_argument(
        "-d",
        "--details",
        action="store_true",
        help="with --cluster: per node, the pods on each card",
    )
    parser.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="with --cluster: the kubeconfig to use (default: kubernetes.kubeconfig of the "
        "config, then $KUBECONFIG, in-cluster, ~/.kube/config); it must allow nodes list",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(config_error_line(e), file=sys.stderr)
        return 2
    if getattr(args, "cluster", False):
        return run_cluster(args, settings)
    if getattr(args, "details", False) or getattr(args, "kubeconfig", None):
        print("nodemgr: --details and --kubeconfig go with --cluster", file=sys.stderr)
        return 2
    code = 0
    try:
        status = query(settings.status_socket)
    except PermissionError:
        print(
            f"nodemgr: permission denied on {settings.status_socket} (root only): "
            "run it as root, e.g. sudo nodemgr status",
            file=sys.stderr,
        )
        return 1
    except (OSError, ProtocolError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        down = f"nodemgr: gpushare-node is not answering on {settings.status_socket} ({why})"
        try:
            status = _from_ledger(settings)
        except LedgerError as ledger_error:
            print(f"{down}, and {ledger_error}", file=sys.stderr)
            return EXIT_DAEMON_DOWN
        print(
            f"{down}; showing the last state from the ledger. "
            "Check: systemctl status gpushare-node",
            file=sys.stderr,
        )
        code = EXIT_DAEMON_DOWN
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(render_table(status, time.time()))
    return code


def _cards(text: str | None, where: str) -> list[SimpleNamespace]:
    try:
        cards = [SimpleNamespace(**card) for card in json.loads(text or "[]")]
        for card in cards:
            card.index, card.uuid, card.name, card.memory_mib  # noqa: B018 (all four needed)
    except (ValueError, TypeError, AttributeError) as e:
        raise LedgerError(f"the card list kept in {where} is unreadable ({e})") from e
    return cards


def _from_ledger(settings: Settings) -> dict:
    if not os.path.exists(os.path.join(settings.state_dir, LEDGER_FILE)):
        raise LedgerError(
            f"no ledger in {settings.state_dir}: gpushare-node has not run here with this "
            "state_dir (is --config the daemon's config?)"
        )
    ledger = Ledger(settings.state_dir, read_only=True)
    try:
        cards = _cards(ledger.get_meta(CARDS_META_KEY), ledger.path)
        containers: dict[str, int] = {}
        for registration in ledger.load_registrations():
            containers[registration.allocation_id] = (
                containers.get(registration.allocation_id, 0) + 1
            )
        return build_status(
            settings.node_name,
            cards,
            ledger.load(),
            source="ledger",
            card_problems=None,
            mps={} if settings.mps.enabled else None,
            usage=None,
            containers=containers,
            violations=ledger.violation_counts(),
            enforcement=None,
            daemon=None,
        )
    finally:
        ledger.close()
