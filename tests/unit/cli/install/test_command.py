"""Pins the exit statuses of ``nodemgr install``: 2 with what to do when the existing config
is unusable, 1 when the console scripts cannot be found; nothing is written then."""

from __future__ import annotations

import os
import sys

from tests.unit.cli.install.support import CONFIG, nodemgr, tree, write_config


def test_bad_existing_config_stops_install_with_exit_2(tmp_path, capsys):
    """An unusable existing config stops install with exit 2, naming the key, and writes nothing."""
    write_config(tmp_path, {"kubernetes": {"enabled": "yes"}})
    code, out, err = nodemgr(capsys, "install", "--root", str(tmp_path))
    assert code == 2
    assert "config error: kubernetes.enabled" in err and "check-config" in err
    assert set(tree(tmp_path)) == {CONFIG}


def test_missing_console_script_is_refused(tmp_path, capsys, monkeypatch):
    """Without the gpushare-node console script install refuses with exit 1 and writes nothing."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    code, out, err = nodemgr(capsys, "install", "--root", str(tmp_path))
    assert code == 1
    assert "cannot find the gpushare-node console script" in err and "pip install" in err
    assert os.listdir(tmp_path) == []
