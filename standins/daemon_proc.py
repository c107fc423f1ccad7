"""Runs the real ``gpushare-node`` process for end-to-end tests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import yaml

from mps.mounts import parse_mountinfo
from standins import exitwait
from standins.paths import MPS_STANDIN

GPU0 = "GPU-e2e00000-0000-4000-8000-000000000000"
GPU1 = "GPU-e2e00001-0000-4000-8000-000000000001"
MEMORY = "aliyun.com/gpu-mem"
CORE = "aliyun.com/gpu-core.percentage"
WHOLE = "nvidia.com/gpu"


def _console_script(name: str) -> list[str]:
    """The installed console script next to this Python, else the module."""
    script = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(script):
        return [script]
    module = {"gpushare-node": "nodemgr.runtime.main", "nodemgr": "nodemgr.cli.main"}[name]
    return [sys.executable, "-m", module]


class Node:
    """A node's directories, its config, and the gpushare-node process on it."""

    def __init__(self, control_binary: str = MPS_STANDIN, **overrides):
        """``control_binary``: the MPS control binary (the stand-in, or NVIDIA's real one
        from standins.real_parts); ``overrides`` replace top-level config keys."""
        # Unix socket paths must stay under 108 bytes: pytest's tmp_path is too long.
        self.root = tempfile.mkdtemp(prefix="gs-", dir="/tmp")
        self.device_plugin_dir = os.path.join(self.root, "dp")
        self.pod_resources_socket = os.path.join(self.root, "pr", "kubelet.sock")
        self.config_path = os.path.join(self.root, "config.yaml")
        self.log_path = os.path.join(self.root, "daemon.log")
        config = {
            "node_name": "node-a",
            "kubelet": {
                "device_plugin_dir": self.device_plugin_dir,
                "pod_resources_socket": self.pod_resources_socket,
                "reconcile_interval_seconds": 0.5,
                "allocation_grace_seconds": 3,
            },
            "state_dir": os.path.join(self.root, "state"),
            "run_dir": os.path.join(self.root, "run"),
            "metrics": {"address": "127.0.0.1:0"},  # tests run side by side
            "mps": {
                "control_binary": control_binary,
                "health_check_interval_seconds": 0.5,
                "command_timeout_seconds": 2,
                "shm_size_mib": 64,
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
        }
        for key, value in overrides.items():
            config[key] = value
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config, f)
        self.process: subprocess.Popen | None = None

    def start(self, env: dict[str, str] | None = None, nofile: int | None = None) -> None:
        """Start gpushare-node; ``env`` adds to (or, with "", removes from) our environment;
        ``nofile`` sets its RLIMIT_NOFILE, soft and hard (``prlimit``, which execs it: the
        daemon keeps the PID), as a unit without LimitNOFILE= gets systemd's soft 1024."""
        environ = dict(os.environ)
        for name, value in (env or {}).items():
            if value:
                environ[name] = value
            else:
                environ.pop(name, None)
        log = open(self.log_path, "a")
        limit = [] if nofile is None else ["prlimit", f"--nofile={nofile}:{nofile}", "--"]
        self.process = subprocess.Popen(
            [*limit, *_console_script("gpushare-node"), "--config", self.config_path],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environ,
        )
        log.close()

    def rewrite_config(self, change) -> None:
        """Apply ``change(config_dict)`` to the config file (before ``start``)."""
        with open(self.config_path) as f:
            config = yaml.safe_load(f)
        change(config)
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config, f)

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout: float) -> int:
        """The daemon's exit status, as soon as it exits (shutdown timings use it)."""
        return exitwait.wait_for_exit(self.process, timeout)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def allocations(self) -> list[dict]:
        return self._nodemgr_json("allocations")["allocations"]

    def violations(self) -> list[dict]:
        return self._nodemgr_json("violations")["violations"]

    def nodemgr(self, *args: str) -> subprocess.CompletedProcess:
        """``nodemgr ARGS --config <this node's config>``, output captured as text."""
        return subprocess.run(
            [*_console_script("nodemgr"), *args, "--config", self.config_path],
            capture_output=True,
            text=True,
        )

    def _nodemgr_json(self, command: str) -> dict:
        out = subprocess.run(
            [*_console_script("nodemgr"), command, "--config", self.config_path, "--json"],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            raise AssertionError(f"nodemgr {command} exited {out.returncode}: {out.stderr}")
        return json.loads(out.stdout)

    def wait_for(self, predicate, timeout: float = 10.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; daemon log:\n{self.log()}")

    def mps_daemons(self) -> dict[str, int]:
        """Card UUID -> PID of each MPS control daemon serving a pipe dir of this node."""
        found = {}
        for proc in psutil.process_iter(["cmdline"]):
            if "-d" not in (proc.info["cmdline"] or []):
                continue
            try:
                pipe = proc.environ().get("CUDA_MPS_PIPE_DIRECTORY", "")
            except (psutil.Error, OSError):
                continue
            if pipe.startswith(self.root + "/"):
                found[proc.environ()["CUDA_VISIBLE_DEVICES"]] = proc.pid
        return found

    def cleanup(self) -> None:
        self.stop()
        for pid in self.mps_daemons().values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        unmount_under(os.path.join(self.root, "run"))
        shutil.rmtree(self.root, ignore_errors=True)


def unmount_under(directory: str) -> None:
    """Unmount what the daemon mounted under ``directory`` (the cards' /dev/shm tmpfs,
    their MPS namespaces and the directory keeping them), the deepest first, as a reboot
    would; lazily, so a container still holding one does not stop the cleanup."""
    prefix = os.path.abspath(directory) + "/"
    with open("/proc/self/mountinfo", "rb") as f:
        points = [entry.mount_point for entry in parse_mountinfo(f.read())]
    for point in sorted({p for p in points if p.startswith(prefix)}, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
