"""A node under a real systemd 252: a booted systemd-nspawn container with gpushare installed.

The ``node`` fixture (one per module) boots the cached root file system
(``standins/nspawn.py``), writes a config for two simulated GPUs with the
MPS stand-in, and runs ``nodemgr install`` inside, with the console scripts of
the bind-mounted venv, then ``systemctl daemon-reload`` and
``systemd-tmpfiles --create``. The test kubelet runs inside as the transient
unit ``test-kubelet.service`` (``systemd-run``). The container is powered off
and every trace of it removed after the module, even when a test failed.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import yaml

from standins.nspawn import Container, require
from standins.paths import MPS_STANDIN, REPO

GPU0 = "GPU-5a000000-0000-4000-8000-000000000000"
GPU1 = "GPU-5a000001-0000-4000-8000-000000000001"
UNIT = "gpushare-node.service"
CONFIG_PATH = "/etc/gpushare/config.yaml"
RUN_DIR = "/run/gpushare"
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
KUBELET_UNIT = "test-kubelet.service"
KUBELET_STATE = "/run/test-kubelet.json"
VENV_BIN = os.path.dirname(sys.executable)
RESOURCES = ["aliyun.com/gpu-mem", "aliyun.com/gpu-core.percentage", "nvidia.com/gpu"]
SERVING = "serving 3 resources on 2 GPUs, 0 allocations"


def config(**enforcement) -> dict:
    return {
        "node_name": "nspawn-node",
        "kubelet": {
            "device_plugin_dir": DEVICE_PLUGIN_DIR,
            "pod_resources_socket": POD_RESOURCES_SOCKET,
        },
        "gpus": {
            "backend": "simulated",
            "simulated": {
                "devices": [
                    {"uuid": GPU0, "name": "Tesla T4", "memory_mib": 15360},
                    {"uuid": GPU1, "name": "Tesla T4", "memory_mib": 15360},
                ]
            },
        },
        "mps": {
            "control_binary": MPS_STANDIN,
            "shm_size_mib": 64,
            "health_check_interval_seconds": 1,
        },
        "enforcement": {"action": "kill", **enforcement},
        "kubernetes": {"enabled": False},
    }


class SystemdNode:
    """The container, with what the tests do on it."""

    def __init__(self, container: Container):
        self.c = container

    def write_config(self, data: dict | str) -> None:
        text = data if isinstance(data, str) else yaml.safe_dump(data)
        self.c.write_text(CONFIG_PATH, text)

    def nodemgr(self, *args: str, check: bool = False):
        return self.c.run(f"{VENV_BIN}/nodemgr", *args, check=check)

    def show(self, *properties: str, unit: str = UNIT) -> dict[str, str]:
        return self.c.show(unit, *properties)

    def status_text(self) -> str:
        return self.show("StatusText")["StatusText"]

    def main_pid(self, unit: str = UNIT) -> int:
        return int(self.show("MainPID", unit=unit)["MainPID"])

    # --- the test kubelet ---------------------------------------------------------------

    def start_kubelet(self) -> None:
        if self.show("ActiveState", unit=KUBELET_UNIT)["ActiveState"] == "active":
            return
        self.c.systemctl("reset-failed", KUBELET_UNIT, check=False)
        self.c.run(
            "systemd-run",
            f"--unit={KUBELET_UNIT}",
            f"--working-directory={REPO}",
            "--property=Environment=PYTHONDONTWRITEBYTECODE=1",
            sys.executable,
            "-m",
            "standins.nspawn",
            "kubelet",
            DEVICE_PLUGIN_DIR,
            POD_RESOURCES_SOCKET,
            KUBELET_STATE,
        )

    def stop_kubelet(self) -> None:
        self.c.systemctl("stop", KUBELET_UNIT, check=False)
        self.c.run("rm", "-f", KUBELET_STATE)

    def kubelet_registrations(self) -> list[str]:
        try:
            return json.loads(self.c.read_text(KUBELET_STATE))["registrations"]
        except (OSError, ValueError):
            return []

    # --- gpushare-node ------------------------------------------------------------------

    def ensure_running(self) -> None:
        """The test kubelet up and gpushare-node started (READY) and enabled."""
        self.start_kubelet()
        self.c.systemctl("reset-failed", UNIT, check=False)
        self.c.systemctl("enable", "--now", UNIT, timeout=90)
        assert self.show("ActiveState")["ActiveState"] == "active"

    def journal_since(self, cursor: str, unit: str = UNIT) -> str:
        return self.c.run(
            "journalctl", "--no-pager", "-o", "cat", f"--after-cursor={cursor}", "-u", unit
        ).stdout

    def cursor(self) -> str:
        done = self.c.run("journalctl", "--no-pager", "-n", "0", "--show-cursor", "-q")
        return done.stdout.strip().removeprefix("-- cursor: ")

    # --- the MPS stand-in ---------------------------------------------------------------

    def pipe_dir(self, uuid: str) -> str:
        return f"{RUN_DIR}/mps/{uuid}/pipe"

    def mps(self, uuid: str, command: str):
        """One command to the card's control daemon, through the control binary."""
        return self.c.run(
            "env",
            f"CUDA_MPS_PIPE_DIRECTORY={self.pipe_dir(uuid)}",
            MPS_STANDIN,
            input=command + "\n",
            check=False,
        )

    def mps_pid(self, uuid: str) -> int | None:
        """The PID (inside the container) of the card's control daemon, None when none answers."""
        done = self.mps(uuid, "sim_pid")
        answer = done.stdout.strip()
        return int(answer) if done.returncode == 0 and answer.isdigit() else None

    def alive(self, pid: int) -> bool:
        return self.c.run("kill", "-0", str(pid), check=False).returncode == 0

    def wait_for(self, predicate, timeout: float, what: str):
        return self.c.wait_for(predicate, timeout, what)


@pytest.fixture(scope="module")
def node():
    rootfs = require()
    container = Container(rootfs)
    started = time.monotonic()
    try:
        container.boot()
        systemd_node = SystemdNode(container)
        systemd_node.write_config(config())
        done = systemd_node.nodemgr("install", check=True)
        assert f"{VENV_BIN}/gpushare-node" in done.stdout
        container.systemctl("daemon-reload")
        container.run("systemd-tmpfiles", "--create", "/etc/tmpfiles.d/gpushare.conf")
        print(f"container {container.name} up and installed in {time.monotonic() - started:.1f} s")
        yield systemd_node
    except BaseException:
        print(f"container console (last lines):\n{container.console()}")
        raise
    finally:
        container.close()


@pytest.fixture
def running(node):
    node.ensure_running()
    return node
