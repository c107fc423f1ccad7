"""``nodemgr install`` / ``nodemgr uninstall`` on the command line: flags and exit statuses.

Exit status: 0; 1 when a file was kept, units are still enabled, install cannot go on
or a file operation fails; 2 when the config is unusable.
"""

from __future__ import annotations

import argparse
import os
import sys

from nodemgr.cli.install.apply import install, uninstall
from nodemgr.cli.install.render import CONFIG_PATH, InstallError
from nodemgr.cli.install.scheduler import SCHEDULER_KUBECONFIG, install_scheduler
from nodemgr.config.loading import config_error_line
from nodemgr.errors import ConfigError


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "install",
        help="write the systemd units, tmpfiles.d entry, default config and runtime hook configs",
    )
    parser.add_argument(
        "--root", default="/", metavar="DIR", help="write under DIR instead of / (default /)"
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"the config file gpushare-node.service passes to the daemon: its path on the "
        f"node, read under DIR; it must exist (default {CONFIG_PATH}, written with the defaults "
        "when absent)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    parser.add_argument(
        "--scheduler",
        action="store_true",
        help="write only gpushare-scheduler.service, the scheduler extender on 127.0.0.1:32766 "
        "for kube-scheduler on this control-plane node (no node daemon files)",
    )
    parser.add_argument(
        "--scheduler-kubeconfig",
        metavar="FILE",
        help=f"with --scheduler: the extender's kubeconfig on the node (default "
        f"{SCHEDULER_KUBECONFIG})",
    )
    parser.set_defaults(run=_run_install)
    parser = sub.add_parser(
        "uninstall", help="remove the files nodemgr install wrote (keeps the config and state)"
    )
    parser.add_argument("--root", default="/", metavar="DIR", help="the root install used")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, remove nothing")
    parser.set_defaults(run=_run_uninstall)


def _run_install(args: argparse.Namespace) -> int:
    if args.scheduler:
        return _guarded(
            lambda: install_scheduler(_root(args.root), args.scheduler_kubeconfig, args.dry_run),
            "install",
        )
    if args.scheduler_kubeconfig:
        print("nodemgr install: --scheduler-kubeconfig goes with --scheduler", file=sys.stderr)
        return 2
    return _guarded(lambda: install(_root(args.root), args.config, args.dry_run), "install")


def _run_uninstall(args: argparse.Namespace) -> int:
    return _guarded(lambda: uninstall(_root(args.root), args.dry_run), "uninstall")


def _root(root: str) -> str:
    if not os.path.isdir(root):
        raise InstallError(f"--root {root}: no such directory; create it first")
    return os.path.abspath(root)


def _guarded(action, name: str) -> int:
    try:
        return action()
    except ConfigError as e:
        print(config_error_line(e), file=sys.stderr)
        print(
            f"nodemgr {name}: fix the config (nodemgr check-config --config FILE), then run "
            "this again",
            file=sys.stderr,
        )
        return 2
    except InstallError as e:
        print(f"nodemgr {name}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"nodemgr {name}: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1
