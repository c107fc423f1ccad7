import argparse

import pytest

from nodemgr.cli import main as cli_main
from nodemgr.common.version import package_version
from nodemgr.runtime import main as daemon_main


@pytest.mark.parametrize(
    ("entry", "prog"), [(cli_main.main, "nodemgr"), (daemon_main.main, "gpushare-node")]
)
def test_version_prints_the_installed_version(entry, prog, capsys):
    """`nodemgr --version` and `gpushare-node --version` print the program and the version
    pip installed, and exit 0 without reading any config."""
    with pytest.raises(SystemExit) as exit_:
        entry(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"{prog} {package_version()}"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_every_config_option_says_what_it_is(monkeypatch):
    """Every nodemgr subcommand that takes --config explains it in --help (no bare FILE)."""
    captured = {}
    real_parse = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        captured.setdefault("parser", self)
        return real_parse(self, ["check-config"])

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    cli_main.main([])
    commands = _subparsers(captured["parser"])
    with_config = {
        name: action
        for name, sub in commands.items()
        for action in sub._actions
        if "--config" in action.option_strings
    }
    assert {"status", "doctor", "check-config", "check-ledger", "allocations"} <= set(with_config)
    for name, action in with_config.items():
        assert action.help and len(action.help) > 20, f"nodemgr {name} --config has no help"
