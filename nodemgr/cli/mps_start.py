"""``nodemgr mps-start [--config FILE] <card UUID>``: start one card's MPS control daemon
as gpushare-node starts it, for the ``gpushare-mps@<card UUID>`` unit.

gpushare-node then adopts the daemon as it is. It returns once the daemon answers,
which the unit's ``Type=forking`` waits for. Exit status: 0 started, 1 not started
(already answering, or one line saying why), 2 bad config or not a card of this node.
"""

from __future__ import annotations

import argparse
import sys

from mps import MpsError, MpsLayout
from mps.mounts import MountError
from nodemgr.config.loading import CONFIG_HELP, config_error_line, load_settings
from nodemgr.errors import ConfigError, InventoryError
from nodemgr.inventory import open_inventory
from nodemgr.supervision.supervisor import start_card_daemon


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "mps-start", help="start a card's MPS control daemon as gpushare-node does (units)"
    )
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    parser.add_argument("card", metavar="UUID", help="the card's UUID (nvidia-smi -L)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(config_error_line(e), file=sys.stderr)
        return 2
    try:
        inventory = open_inventory(settings.gpus)
        try:
            cards = [card.uuid for card in inventory.cards()]
        finally:
            inventory.close()
    except InventoryError as e:
        print(f"nodemgr mps-start: {e}", file=sys.stderr)
        return 1
    if args.card not in cards:
        print(
            f"nodemgr mps-start: {args.card!r} is not a card of this node (its cards: "
            f"{', '.join(cards) or 'none'})",
            file=sys.stderr,
        )
        return 2
    try:
        pid = start_card_daemon(settings.mps, MpsLayout(settings.run_dir), args.card, len(cards))
    except (MpsError, MountError, OSError) as e:
        print(f"nodemgr mps-start: {args.card}: {e}", file=sys.stderr)
        return 1
    print(f"{args.card}: MPS control daemon started (pid {pid})")
    return 0
