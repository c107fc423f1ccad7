"""Doctor's ``config`` line: the config file given, the defaults, or why it is unusable.

It warns when doctor checks the built-in defaults although ``nodemgr install`` put a
config on this node: the daemon would use other paths.
"""

from __future__ import annotations

from nodemgr.cli.doctor.report import FAIL, PASS, WARN, Result
from nodemgr.config.loading import config_error_line
from nodemgr.config.schema import Settings
from nodemgr.errors import ConfigError

# nodemgr.cli.install.render.CONFIG_PATH (a sibling package: a test keeps them equal).
INSTALLED_CONFIG = "/etc/gpushare/config.yaml"


def config_result(path: str | None, settings: Settings, installed_config: bool) -> Result:
    """``installed_config``: no --config was given, yet INSTALLED_CONFIG exists on this node."""
    valid = f"valid (node {settings.node_name}, GPU backend {settings.gpus.backend})"
    if path:
        return Result("config", PASS, f"{path}: {valid}")
    if installed_config:
        return Result(
            "config",
            WARN,
            f"no --config: checking the built-in defaults, but {INSTALLED_CONFIG} exists "
            "(the config the installed gpushare-node.service uses)",
            f"nodemgr doctor --config {INSTALLED_CONFIG}",
        )
    return Result(
        "config",
        PASS,
        f"no --config: the built-in defaults are {valid}; give the daemon's --config FILE "
        "to check its settings",
    )


def config_error_result(path: str | None, err: ConfigError) -> Result:
    return Result(
        "config",
        FAIL,
        config_error_line(err).removeprefix("gpushare-node: "),
        f"correct {err.key} in {path} (`nodemgr check-config --config {path}` rechecks it); "
        "nothing else was checked",
    )
