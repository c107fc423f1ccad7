"""Pins ``nodemgr check-ledger``: a sound ledger exits 0 with its counts; a broken one
exits 1 naming each problem (also as JSON); no ledger exits 1; a bad config exits 2; and
``nodemgr doctor``'s ledger check FAILs on a broken ledger."""

import json

import pytest
import yaml

from nodemgr.allocation.ledger import Ledger
from nodemgr.cli import main as cli
from nodemgr.cli.doctor.daemon import check_ledger
from nodemgr.cli.doctor.report import FAIL, PASS
from nodemgr.config.loading import load_settings
from nodemgr.domain.deviceids import ResourceKind, memory_device_id
from nodemgr.domain.model import Allocation
from standins.cards import GPU0

MEM = ResourceKind.MEMORY


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.yaml"
    document = {
        "node_name": "node-a",
        "state_dir": str(tmp_path / "state"),
        "run_dir": str(tmp_path / "run"),
        "gpus": {
            "backend": "simulated",
            "simulated": {"devices": [{"uuid": GPU0, "name": "T4", "memory_mib": 2048}]},
        },
    }
    path.write_text(yaml.safe_dump(document))
    return str(path)


def write(config, *allocations):
    ledger = Ledger(load_settings(config).state_dir)
    ledger.commit(put=list(allocations))
    ledger.close()


def unit(id_, index):
    return Allocation(id_, {MEM: (memory_device_id(GPU0, index),)}, 1024, 1.0)


def run(capsys, *args):
    code = cli.main(["check-ledger", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_sound_ledger_passes_with_its_counts(config, capsys):
    """Two allocations within the card: exit 0, 'sound', the counts."""
    write(config, unit("ga-1", 0), unit("ga-2", 1))
    code, out, _ = run(capsys, "--config", config)
    assert code == 0
    assert "sound (2 allocation(s), 0 registered container(s))" in out
    assert check_ledger(load_settings(config)).status == PASS


def test_a_broken_ledger_names_each_problem(config, capsys):
    """Three units on a two-unit card (written behind the daemon's back): exit 1, the
    problem named, in text and JSON; doctor FAILs naming it too."""
    write(config, unit("ga-1", 0), unit("ga-2", 1), unit("ga-3", 2))
    code, out, _ = run(capsys, "--config", config)
    assert code == 1
    assert "GPU0 has 3 memory units allocated of 2" in out
    code, out, _ = run(capsys, "--config", config, "--json")
    document = json.loads(out)
    assert code == 1 and document["sound"] is False and document["capacities_checked"] is True
    assert any("beyond GPU0's 2 memory devices" in p for p in document["problems"])
    result = check_ledger(load_settings(config))
    assert result.status == FAIL and "breaks its invariants" in result.detail


def test_no_ledger_and_a_bad_config(tmp_path, config, capsys):
    """No ledger yet: exit 1 saying so; an unreadable config: exit 2, one line."""
    code, _, err = run(capsys, "--config", config)
    assert code == 1 and "no ledger in" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("kubelet: [")
    code, _, err = run(capsys, "--config", str(bad))
    assert code == 2 and "config error" in err
