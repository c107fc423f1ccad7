"""``nodemgr doctor``: what this node lacks for gpushare-node, and the fix for each.

Exit status: 0 when nothing FAILs, 1 when something does, 2 when the config itself is
unusable (nothing else is checked then: every check reads its paths from it). Each
check is a thin probe followed by a pure verdict function (``*_result``), which the
unit tests pin; one module per check family.

What it must not do: change anything. Its only requests that reach a server are a
no-op ``poststop`` on the hook socket (answered from memory) and, with
``kubernetes.enabled``, GETs and SelfSubjectAccessReviews (stored nowhere).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from nodemgr.cli.doctor.config_checks import INSTALLED_CONFIG, config_error_result, config_result
from nodemgr.cli.doctor.daemon import check_daemon, check_ledger
from nodemgr.cli.doctor.gpu import check_gpus, check_mps_binary
from nodemgr.cli.doctor.host import Host
from nodemgr.cli.doctor.kubelet import check_kubelet_sockets
from nodemgr.cli.doctor.kubernetes_api import check_kubernetes
from nodemgr.cli.doctor.placement import check_placement_key
from nodemgr.cli.doctor.report import FAIL, Result, render
from nodemgr.cli.doctor.runtime_hook import check_runtime_hook
from nodemgr.cli.doctor.system import check_cgroups, check_privileges
from nodemgr.config.loading import CONFIG_HELP, load_settings
from nodemgr.config.schema import Settings
from nodemgr.errors import ConfigError


def add_parser(sub) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="check what this node needs for gpushare-node (changes nothing)",
        description="One line per check: PASS, WARN or FAIL with the fix. "
        "Exit 1 if any check FAILs, 2 if the config file is unusable.",
    )
    doctor.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(run=run)


def run(args, host: Host | None = None) -> int:
    host = host or Host()
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        results = [config_error_result(args.config, e)]
        code = 2
    else:
        results = run_checks(settings, args.config, host)
        code = 1 if any(r.status == FAIL for r in results) else 0
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(render(results))
    return code


def run_checks(settings: Settings, config_path: str | None, host: Host) -> list[Result]:
    installed = config_path is None and os.path.isfile(host.path(INSTALLED_CONFIG))
    results = [config_result(config_path, settings, installed), check_privileges(host)]
    results += check_gpus(settings, host)
    results.append(check_mps_binary(settings, host))
    results += check_kubelet_sockets(settings, host)
    results.append(check_cgroups(host))
    results.append(check_runtime_hook(settings, host))
    results.append(check_daemon(settings, host))
    results.append(check_ledger(settings))
    results.append(check_kubernetes(settings, host))
    results.append(check_placement_key(settings, host))
    return results
