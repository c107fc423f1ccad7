"""A node whose cards' MPS runs a given control binary (NVIDIA's real one from
standins.real_parts, or the stand-in), with runc tenants made from real Allocate
responses that carry that binary and its libraries, read-only.

Shared by the MPS identity tests (tests/e2e/test_mps_identity.py) and the hostile-tenant
table (tests/hostile): a root container asking its card's daemon to ``quit``, a container
posing as the daemon (argv, environ, NVIDIA's own binary on the card's pipe path), and a
crash of the real daemon that the supervisor must survive by identifying the real one anew.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

from standins import runc_env
from standins.daemon_proc import GPU0, MEMORY
from standins.kubelet_sim import ContainerSpec

IN_CONTAINER_BINARY = "/usr/bin/nvidia-cuda-mps-control"
NO_PRIVILEGE = "Not enough privilege to execute quit command"
DAEMON_LINE = re.compile(r"\[[^]]* Control +(\d+)\] Starting control daemon using socket")
READY_LINE = re.compile(r"GPU0: MPS ready \(control daemon pid (\d+),")
# Written into the rootfs by the tests that use it: poses as the control daemon (its argv
# holds nvidia-cuda-mps-control and -d, its env the card's host pipe directory) and keeps
# a child that would be exempt if the pose worked.
IMPOSTOR = "#!/bin/sh\nsleep 1000 &\nwait\n"


class MpsNode(runc_env.EnforcementNode):
    """runc_env.EnforcementNode, with the control binary given (it always runs the
    stand-in): the daemon, the test kubelet, runc with the hook."""

    def __init__(self, control_binary: str, action: str = "kill", nofile: int | None = None):
        super().__init__(action, control_binary, nofile)
        self.binary = control_binary

    def pipe_dir(self) -> str:
        return os.path.join(self.node.root, "run", "mps", GPU0, "pipe")

    def daemon_pid(self) -> int:
        """The card's control daemon as its own control.log names it (the last start)."""
        log = os.path.join(self.node.root, "run", "mps", GPU0, "log", "control.log")
        if not os.path.exists(log):
            return 0
        with open(log) as f:
            pids = DAEMON_LINE.findall(f.read())
        return int(pids[-1]) if pids else 0

    def ready_pids(self) -> list[int]:
        """The control daemons gpushare-node verified and set up, in order."""
        return [int(pid) for pid in READY_LINE.findall(self.node.log())]

    def wait_mps_ready(self) -> int:
        """GPU0's control daemon, once gpushare-node verified and set it up."""
        self.node.wait_for(lambda: self.daemon_pid() in self.ready_pids(), 20, "MPS ready")
        return self.daemon_pid()

    def tenant(self, name: str, edits=()) -> str:
        """A shared container made from a real Allocate response (its read-only mounts
        read-only), with the control binary and its libraries bind-mounted read-only."""
        result = self.kubelet.admit_pod("default", name, [ContainerSpec("main", {MEMORY: 4})])
        assert result.ok, result.error
        admitted = result.containers[0]
        read_only = {m.container_path for m in admitted.mounts if m.read_only}
        mounts = sorted({(m.container_path, m.host_path) for m in admitted.mounts})

        def edit(config: dict) -> None:
            for mount in config["mounts"]:
                if mount["destination"] in read_only:
                    mount["options"] = ["rbind", "ro"]
            config["mounts"] += [
                bind(self.binary, IN_CONTAINER_BINARY),
                bind(os.path.realpath("/lib/x86_64-linux-gnu"), "/lib/x86_64-linux-gnu"),
                bind(os.path.realpath("/lib64"), "/lib64"),
            ]
            for change in edits:
                change(config)

        done = self.start_in_pod(name, name, dict(admitted.envs), mounts, edit=edit)
        assert done.returncode == 0, done.stdout
        return name

    def run_in(self, container: str, script: str) -> subprocess.CompletedProcess:
        """``script`` in the container (as root, its env), waited for, output captured."""
        return subprocess.run(
            ["runc", "--root", self.runtime.state_root, "exec", container, "/bin/sh", "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
        )

    def control(self, container: str, command: str) -> subprocess.CompletedProcess:
        return self.run_in(container, f"echo '{command}' | {IN_CONTAINER_BINARY}")

    def card_health(self) -> set[str]:
        return {d.health for d in self.kubelet.devices(MEMORY) if d.id.startswith(GPU0)}

    def pose_as_daemon(self) -> tuple[str, int]:
        """Two impostors in a shared container with the host's network: a script whose
        argv and env are the card's daemon's, and NVIDIA's own binary run with -d on the
        card's host pipe path (a listening socket bound there). Returns the attacker
        container and the script impostor's PID; both sockets are checked to listen in
        one namespace."""
        pipe = self.pipe_dir()
        script = write_impostor(self.runtime.rootfs)
        self.wait_mps_ready()
        attacker = self.tenant("attacker", (host_network, scratch_at(self.node.root)))
        pose = ("env", f"CUDA_MPS_PIPE_DIRECTORY={pipe}", f"CUDA_VISIBLE_DEVICES={GPU0}")
        impostor = self.runtime.exec(attacker, *pose, script, "-d")
        assert self.run_in(attacker, f"mkdir -p {pipe}").returncode == 0
        self.runtime.exec(attacker, *pose, IN_CONTAINER_BINARY, "-d")

        def listening() -> int:
            done = self.run_in(attacker, f"grep -c ' {pipe}/control$' /proc/net/unix")
            return int(done.stdout or 0)

        # The real daemon's and the impostor's, in one namespace, once the impostor (which
        # forks into the background) has bound its socket.
        self.node.wait_for(lambda: listening() == 2, 10, "the impostor's socket")
        return attacker, impostor

    def restart_daemon(self) -> int:
        """Kill the card's daemon from the host (a crash); the PID of the one that
        gpushare-node starts instead, once it is set up and the card Healthy again."""
        old = self.daemon_pid()
        os.kill(old, signal.SIGKILL)
        self.node.wait_for(lambda: self.daemon_pid() not in (0, old), 20, "a restarted daemon")
        new = self.daemon_pid()
        self.node.wait_for(lambda: new in self.ready_pids(), 20, f"daemon {new} set up")
        self.kubelet.wait_for_devices(
            MEMORY, lambda ds: {d.health for d in ds if d.id.startswith(GPU0)} == {"Healthy"}
        )
        return new


def bind(source: str, destination: str) -> dict:
    return {
        "destination": destination,
        "source": source,
        "type": "bind",
        "options": ["rbind", "ro"],
    }


def host_network(config: dict) -> None:
    """As a hostNetwork pod: its unix sockets show in the host's /proc/net/unix, and it
    reaches the host's loopback."""
    namespaces = config["linux"]["namespaces"]
    config["linux"]["namespaces"] = [n for n in namespaces if n["type"] != "network"]


def scratch_at(path: str):
    """A tmpfs at ``path`` in the container, so it can make the host's pipe path its own."""

    def change(config: dict) -> None:
        config["mounts"].append(
            {"destination": path, "type": "tmpfs", "source": "tmpfs", "options": ["mode=755"]}
        )

    return change


def write_impostor(rootfs: str) -> str:
    """The IMPOSTOR script at /opt/forge/nvidia-cuda-mps-control of ``rootfs``; its path
    in the container."""
    forge = os.path.join(rootfs, "opt", "forge")
    os.makedirs(forge, exist_ok=True)
    path = os.path.join(forge, "nvidia-cuda-mps-control")
    with open(path, "w") as f:
        f.write(IMPOSTOR)
    os.chmod(path, 0o755)
    return "/opt/forge/nvidia-cuda-mps-control"


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]
