"""Pins doctor's config line: a given config passes, the defaults pass unless nodemgr install
put a config on this node (then it WARNs, pointing at it), and the installed config path is
the one nodemgr install writes."""

from __future__ import annotations

from types import SimpleNamespace

from nodemgr.cli.doctor import config_checks
from nodemgr.cli.doctor.report import PASS, WARN, Result
from nodemgr.cli.install import render as install_render


def test_config_verdicts_point_at_the_installed_config():
    """A given config passes; without --config the defaults pass, or WARN pointing at the
    installed config."""
    settings = SimpleNamespace(node_name="node-a", gpus=SimpleNamespace(backend="nvml"))
    given = config_checks.config_result("/etc/g.yaml", settings, False)
    assert given == Result("config", PASS, "/etc/g.yaml: valid (node node-a, GPU backend nvml)")
    assert config_checks.config_result(None, settings, False).status == PASS
    installed = config_checks.config_result(None, settings, True)
    assert installed.status == WARN
    assert installed.fix == "nodemgr doctor --config /etc/gpushare/config.yaml"
    assert config_checks.INSTALLED_CONFIG == install_render.CONFIG_PATH
