"""Pins ``nodemgr doctor`` as a whole: a simulated node with a listening kubelet and
pod-resources socket, the stand-in MPS binary, a valid CRI-O hook, a running hook server and
an API server that knows it passes (exit 0: only the simulated-GPU WARN remains); a node
without NVML or kubelet FAILs with the reason and the fix (exit 1, through the real
``nodemgr`` command); a bad config is one FAIL line naming the key (exit 2)."""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import yaml

from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.cli.doctor import command, report
from nodemgr.cli.doctor.host import Host
from nodemgr.cli.doctor.report import FAIL, PASS, WARN
from nodemgr.cli.install import render
from nodemgr.config.loading import load_settings
from nodemgr.enforcement.hookserver import HookServer
from nodemgr.enforcement.registry import ContainerRegistry
from nodemgr.inventory import open_inventory
from nodemgr.status.server import DaemonFacts, LiveStatus, StatusServer
from standins.apiserver_sim import TestApiServer
from standins.daemon_proc import MPS_STANDIN, _console_script
from tests.unit.cli.doctor.support import fake_node, listening, short_dir


class SimulatedNode:
    """A simulated node with everything doctor can find working: a listening kubelet and
    pod-resources socket, the stand-in MPS binary, the shipped CRI-O hooks in a fake root,
    a daemon's real hook and status servers (allocator, registry, ledger) on its sockets,
    and a test API server that knows node-a and allows everything (its kubeconfig in the
    config)."""

    def __init__(self, tmp_path):
        self.api = TestApiServer()
        self.api.start()
        self.api.add_node("node-a")
        self.sockets = short_dir()
        self.hook_socket = f"{self.sockets}/run/hook.sock"
        self.config_path = str(tmp_path / "config.yaml")
        config = {
            "node_name": "node-a",
            "kubelet": {
                "device_plugin_dir": f"{self.sockets}/dp",
                "pod_resources_socket": f"{self.sockets}/pr/kubelet.sock",
            },
            "state_dir": str(tmp_path / "state"),
            "run_dir": f"{self.sockets}/run",
            "mps": {"control_binary": MPS_STANDIN},
            "kubernetes": {"kubeconfig": self.api.write_kubeconfig(tmp_path / "kubeconfig")},
            "gpus": {
                "backend": "simulated",
                "simulated": {
                    "devices": [{"uuid": "GPU-doc0", "name": "Tesla T4", "memory_mib": 15360}]
                },
            },
        }
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config, f)
        # The shipped hook files call /run/gpushare/hook.sock, which a test must not take:
        # the fake root's copies are those nodemgr install writes for this node's config
        # (its socket <run_dir>/hook.sock, its own paths to guard).
        self.host = fake_node(str(tmp_path / "root"))
        hooks_d = tmp_path / "root" / "etc" / "containers" / "oci" / "hooks.d"
        target = render.Target.of(load_settings(self.config_path), "n", "h", self.config_path)
        for spec in render.render(target, with_config=False):
            if spec.path.startswith(render.OCI_HOOKS_DIR + "/"):
                (hooks_d / os.path.basename(spec.path)).write_text(spec.content)
        self.servers = [
            listening(f"{self.sockets}/dp/kubelet.sock"),
            listening(f"{self.sockets}/pr/kubelet.sock"),
        ]
        settings = load_settings(self.config_path)
        self.ledger = Ledger(settings.state_dir)
        allocator = Allocator(settings, open_inventory(settings.gpus).cards(), self.ledger)
        registry = ContainerRegistry(self.ledger, allocator, None)
        self.hook_server = HookServer(registry, self.hook_socket)
        self.hook_server.start()
        facts = DaemonFacts(version="test", ready=True, registered=True)
        live = LiveStatus(
            "node-a", facts, allocator, self.ledger, registry, None, lambda: None, dict
        )
        self.status_server = StatusServer(live, settings.status_socket)
        self.status_server.start()

    def close(self):
        self.status_server.stop()
        self.hook_server.stop()
        self.ledger.close()
        for server in self.servers:
            server.close()
        shutil.rmtree(self.sockets, ignore_errors=True)
        self.api.stop()


def test_simulated_node_passes_what_can_pass(tmp_path, capsys):
    """On a simulated node where everything works, every check passes but the simulated-GPU WARN
    (exit 0)."""
    node = SimulatedNode(tmp_path)
    try:
        code = command.run(SimpleNamespace(config=node.config_path, json=True), node.host)
    finally:
        node.close()
    results = {r["check"]: r for r in json.loads(capsys.readouterr().out)}
    assert {check: r["status"] for check, r in results.items()} == {
        "config": PASS,
        "privileges": PASS,
        "GPUs": WARN,  # simulated: not a real GPU node
        "MPS control binary": PASS,
        "kubelet socket": PASS,
        "pod-resources socket": PASS,
        "cgroups": PASS,
        "runtime hook": PASS,
        "gpushare-node": PASS,
        "ledger": PASS,
        "Kubernetes API": PASS,
        "placement key": WARN,  # no public key configured: the node places every pod
    }
    assert code == 0
    assert all(r["fix"] for r in results.values() if r["status"] != PASS)
    assert results["GPUs"]["detail"].startswith("simulated: not a real GPU node")
    assert results["gpushare-node"]["detail"].startswith("running (pid")
    assert results["Kubernetes API"]["detail"].startswith(f"API server {node.api.url} ")


def test_node_without_kubelet_or_nvml_fails_through_the_real_command(tmp_path):
    """Through the real nodemgr command a node without NVML or kubelet FAILs with reasons and
    fixes (exit 1)."""
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("NVML is installed here: the NVML check may pass")
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "node_name": "node-a",
                "kubelet": {
                    "device_plugin_dir": str(tmp_path / "dp"),
                    "pod_resources_socket": str(tmp_path / "pr" / "kubelet.sock"),
                },
                "state_dir": str(tmp_path / "state"),
                "run_dir": str(tmp_path / "run"),
            }
        )
    )
    done = subprocess.run(
        [*_console_script("nodemgr"), "doctor", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    print(done.stdout)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = {line.split()[1]: line for line in done.stdout.splitlines() if line[:4] in report.RANK}
    assert lines["GPUs"].startswith("FAIL  ")
    assert "NVML" in lines["GPUs"] and "— fix: install the NVIDIA driver" in lines["GPUs"]
    assert lines["kubelet"].startswith("FAIL  kubelet socket")
    assert f"no directory {tmp_path / 'dp'}" in lines["kubelet"]
    assert "set kubelet.device_plugin_dir: DIR/device-plugins" in lines["kubelet"]
    assert "FAIL, " in done.stdout.splitlines()[-1]


def test_this_machine_default_config_has_no_nvml():
    """The one test that looks at this machine: only what is certain here (no NVML)."""
    if ctypes.util.find_library("nvidia-ml") or os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("this machine has an NVIDIA driver")
    done = subprocess.run(
        [*_console_script("nodemgr"), "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    [gpus] = [r for r in json.loads(done.stdout) if r["check"] == "GPUs"]
    assert gpus["status"] == FAIL and "gpus.backend: simulated" in gpus["fix"]


def test_bad_config_is_one_fail_line_naming_the_key(tmp_path, capsys):
    """An unusable config is one FAIL line naming the key and how to recheck it (exit 2)."""
    config = tmp_path / "config.yaml"
    config.write_text("resources:\n  placement: roundrobin\n")
    code = command.run(SimpleNamespace(config=str(config), json=False), Host(root=str(tmp_path)))
    out = capsys.readouterr().out
    assert code == 2
    assert out.splitlines()[0] == (
        "FAIL  config  config error: resources.placement: must be one of binpack, spread "
        f'(got "roundrobin") — fix: correct resources.placement in {config} '
        f"(`nodemgr check-config --config {config}` rechecks it); nothing else was checked"
    )
