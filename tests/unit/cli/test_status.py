"""``nodemgr status`` of this node (nodemgr/cli/status.py) when the daemon does not answer.

Pins: with no daemon and no ledger it says both in one message and exits 3 (the daemon is
not running, as ``systemctl status`` of a stopped unit says), promising nothing; with the
ledger the
daemon left it says the daemon is not answering, shows the last state from the ledger
(``source: ledger``, the cards the daemon kept in the ledger) and exits 3, as ``systemctl
status`` of a stopped unit; a bad config exits 2; the ``--cluster`` flags without
``--cluster`` exit 2. (The daemon answering is pinned end to end in tests/e2e/test_status.py.)
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import yaml

from nodemgr.allocation.ledger import Ledger
from nodemgr.cli import status as status_cli
from nodemgr.status.server import CARDS_META_KEY


def config(tmp_path, **settings) -> str:
    """A config whose run_dir (no daemon: no status socket) and state_dir are under tmp_path."""
    path = tmp_path / "config.yaml"
    document = {"node_name": "node-a", "run_dir": str(tmp_path / "run")}
    document["state_dir"] = str(tmp_path / "state")
    path.write_text(yaml.safe_dump({**document, **settings}))
    return str(path)


def args(config_path, as_json=False, **flags):
    """The argparse namespace ``nodemgr status`` gets, without --cluster."""
    values = dict(config=config_path, json=as_json, cluster=False, details=False, kubeconfig=None)
    return SimpleNamespace(**{**values, **flags})


def test_no_daemon_and_no_ledger_exits_3_promising_nothing(tmp_path, capsys):
    """Without a daemon or a ledger there is nothing to show: one message naming the socket
    and the state_dir, no promise of the ledger's state, and exit 3 (daemon not running)."""
    assert status_cli.run(args(config(tmp_path))) == status_cli.EXIT_DAEMON_DOWN == 3
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "gpushare-node is not answering on " in captured.err
    assert f"no ledger in {tmp_path / 'state'}: gpushare-node has not run here" in captured.err
    assert "showing the last state" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1


def test_daemon_down_shows_the_last_state_from_the_ledger_and_exits_3(tmp_path, capsys):
    """With the daemon down the ledger's last state is shown (source ledger) and it exits 3."""
    path = config(tmp_path)
    ledger = Ledger(str(tmp_path / "state"))
    card = {"index": 0, "uuid": "GPU-0", "name": "Tesla T4", "memory_mib": 15360}
    ledger.set_meta(CARDS_META_KEY, json.dumps([card]))
    ledger.close()
    assert status_cli.run(args(path, as_json=True)) == status_cli.EXIT_DAEMON_DOWN == 3
    captured = capsys.readouterr()
    assert "showing the last state from the ledger" in captured.err
    document = json.loads(captured.out)
    assert (document["source"], document["node"], document["daemon"]) == ("ledger", "node-a", None)
    assert [(g["uuid"], g["model"], g["memory_total_mib"]) for g in document["gpus"]] == [
        ("GPU-0", "Tesla T4", 15360)
    ]
    assert document["allocations"] == []


def test_bad_config_and_cluster_flags_without_cluster_exit_2(tmp_path, capsys):
    """A config that does not load, and -d or --kubeconfig without --cluster, exit 2."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("resources:\n  placement: roundrobin\n")
    assert status_cli.run(args(str(bad))) == 2
    assert "resources.placement" in capsys.readouterr().err
    assert status_cli.run(args(config(tmp_path), details=True)) == 2
    assert capsys.readouterr().err == "nodemgr: --details and --kubeconfig go with --cluster\n"
    assert status_cli.run(args(config(tmp_path), kubeconfig="/k")) == 2
