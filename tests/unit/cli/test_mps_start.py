"""Pins ``nodemgr mps-start`` (what a gpushare-mps@ unit runs), with the stand-in control
binary and, as root, real tmpfs mounts and namespaces: the card's daemon is started as
gpushare-node starts it (on the card's tmpfs, in the card's namespace, so gpushare-node
trusts it and keeps it as it is); a daemon already answering is left alone (exit 1); a
UUID that is not a card of this node is refused (exit 2)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile

import pytest
import yaml

from mps import MpsLayout, proc, shm
from nodemgr.cli.main import main
from nodemgr.config.loading import load_settings
from nodemgr.supervision.supervisor import card_daemon
from standins.cards import GPU0
from standins.daemon_proc import MPS_STANDIN, unmount_under


@pytest.fixture
def config():
    root = tempfile.mkdtemp(prefix="mst-", dir="/tmp")  # short: unix socket paths
    path = os.path.join(root, "config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(
            {
                "run_dir": f"{root}/run",
                "state_dir": f"{root}/state",
                "mps": {"control_binary": MPS_STANDIN, "shm_size_mib": 16},
                "gpus": {
                    "backend": "simulated",
                    "simulated": {
                        "devices": [{"uuid": GPU0, "name": "Tesla T4", "memory_mib": 15360}]
                    },
                },
            },
            f,
        )
    yield path
    for pid in proc.pids():
        environ = proc.read_file(f"/proc/{pid}/environ", 1 << 20) or b""
        if f"CUDA_MPS_PIPE_DIRECTORY={root}/".encode() in environ:
            os.kill(pid, signal.SIGKILL)
    unmount_under(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="a tmpfs and a mount namespace need root")
def test_the_daemon_is_started_as_gpushare_node_starts_it(config, capsys):
    """Started on the card's tmpfs (16 MiB) in the card's namespace: gpushare-node's view
    of the card verifies it and finds it on that tmpfs, so it adopts it as it is."""
    assert main(["mps-start", "--config", config, GPU0]) == 0
    out = capsys.readouterr().out
    settings = load_settings(config)
    layout = MpsLayout(settings.run_dir)
    assert shm.sized(layout.shm_dir(GPU0))[0] == 16 * 2**20
    daemon = card_daemon(settings.mps, layout, GPU0, isolate=True)
    identity = daemon.identify()
    assert identity is not None and f"(pid {identity.pid})" in out
    assert daemon.on_card_shm(identity) is True
    assert os.listdir(layout.client_dir(GPU0)) == ["control"]


def test_a_daemon_already_answering_is_left_alone(config, capsys):
    """A second mps-start for the card: exit 1, saying so; the first daemon runs on."""
    assert main(["mps-start", "--config", config, GPU0]) == 0
    settings = load_settings(config)
    layout = MpsLayout(settings.run_dir)
    daemon = card_daemon(settings.mps, layout, GPU0, isolate=os.geteuid() == 0)
    first = daemon.identify()
    capsys.readouterr()
    assert main(["mps-start", "--config", config, GPU0]) == 1
    assert "already answers" in capsys.readouterr().err
    assert daemon.identify() == first


def test_a_uuid_that_is_not_a_card_here_is_refused(config, capsys):
    assert main(["mps-start", "--config", config, "GPU-nope"]) == 2
    assert "'GPU-nope' is not a card of this node" in capsys.readouterr().err
