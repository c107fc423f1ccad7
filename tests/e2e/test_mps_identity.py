"""MPS against hostile tenants, end to end: the real gpushare-node, the test kubelet, real
runc containers made from real Allocate responses, and NVIDIA's real control binary
(driver 535; its daemon runs without a GPU) bind-mounted into them with its libraries.

Pins (issue 14, items 1 and 2): a root container cannot ``quit`` its card's MPS daemon
(it sees only the card's client directory: ``control``, read-only) while its queries
reach the daemon, also after the daemon restarted; a container posing as the control
daemon (argv, environ, even NVIDIA's own binary holding a socket bound at the card's
pipe path in the host's network namespace) is never taken for it, and a process under
the impostor is judged like any other; the MPS servers of the verified daemon are
spared, and a process running the same server file but not started by that daemon is
not."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from tests.harness import real_parts, runc_env
from tests.harness.daemon_proc import CORE, GPU0, MEMORY, MPS_STANDIN, Node
from tests.harness.kubelet_sim import ContainerSpec, TestKubelet

pytestmark = pytest.mark.e2e

IN_CONTAINER_BINARY = "/usr/bin/nvidia-cuda-mps-control"
NO_PRIVILEGE = "Not enough privilege to execute quit command"
DAEMON_LINE = re.compile(r"\[[^]]* Control +(\d+)\] Starting control daemon using socket")
READY_LINE = re.compile(r"GPU0: MPS ready \(control daemon pid (\d+),")
# Rewritten at each use into the rootfs: poses as the control daemon (its argv holds
# nvidia-cuda-mps-control and -d, its env the card's host pipe directory) and keeps a
# child that would be exempt if the pose worked.
IMPOSTOR = "#!/bin/sh\nsleep 1000 &\nwait\n"


class MpsNode(runc_env.EnforcementNode):
    """runc_env.EnforcementNode, with the control binary given (it always runs the
    stand-in): the daemon, the test kubelet, runc with the hook."""

    def __init__(self, control_binary: str):
        runc_env.require()
        self.node = Node(control_binary)
        self.usage_file = os.path.join(self.node.root, "usage.json")
        self.set_usage([])
        self.node.rewrite_config(
            lambda c: c["gpus"]["simulated"].__setitem__("usage_file", self.usage_file)
        )
        self.hook_socket = os.path.join(self.node.root, "run", "hook.sock")
        self.kubelet = TestKubelet(self.node.device_plugin_dir, self.node.pod_resources_socket)
        self.kubelet.start()
        self.node.start()
        for resource in (MEMORY, CORE):
            self.kubelet.wait_for_resource(resource, timeout=30)
        self.runtime = runc_env.Runtime(self.node.root, self.hook_socket)
        self.binary = control_binary

    def pipe_dir(self) -> str:
        return os.path.join(self.node.root, "run", "mps", GPU0, "pipe")

    def daemon_pid(self) -> int:
        """The card's control daemon as its own control.log names it (the last start)."""
        log = os.path.join(self.node.root, "run", "mps", GPU0, "log", "control.log")
        pids = DAEMON_LINE.findall(open(log).read()) if os.path.exists(log) else []
        return int(pids[-1]) if pids else 0

    def ready_pids(self) -> list[int]:
        """The control daemons gpushare-node verified and set up, in order."""
        return [int(pid) for pid in READY_LINE.findall(self.node.log())]

    def tenant(self, name: str, edits=()) -> str:
        """A shared container made from a real Allocate response (its read-only mounts
        read-only), with NVIDIA's binary and its libraries bind-mounted read-only."""
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
    """As a hostNetwork pod: its unix sockets show in the host's /proc/net/unix."""
    namespaces = config["linux"]["namespaces"]
    config["linux"]["namespaces"] = [n for n in namespaces if n["type"] != "network"]


def scratch_at(path: str):
    """A tmpfs at ``path`` in the container, so it can make the host's pipe path its own."""

    def change(config: dict) -> None:
        config["mounts"].append(
            {"destination": path, "type": "tmpfs", "source": "tmpfs", "options": ["mode=755"]}
        )

    return change


@pytest.fixture
def real_cluster():
    cluster = MpsNode(real_parts.require().mps_control)
    yield cluster
    cluster.close()  # containers first: their impostors would otherwise look like daemons


@pytest.fixture
def standin_cluster():
    cluster = MpsNode(MPS_STANDIN)
    yield cluster
    cluster.close()


def wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not runc_env.running(pid):
            return True
        time.sleep(0.05)
    return False


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_root_container_cannot_quit_mps_and_its_queries_still_work(real_cluster):
    """A root container's `quit` (NVIDIA's client, the env from Allocate) is refused, the
    daemon runs on and the card stays Healthy; its queries reach the daemon; it cannot
    change what the other tenants connect to; and all of this holds after the daemon
    restarted (a new socket, relinked for the running container)."""
    cluster = real_cluster
    cluster.node.wait_for(lambda: cluster.daemon_pid() in cluster.ready_pids(), 20, "MPS ready")
    daemon = cluster.daemon_pid()
    tenant = cluster.tenant("tenant")
    for round in ("first daemon", "restarted daemon"):
        quit_ = cluster.control(tenant, "quit")
        assert (quit_.returncode, quit_.stdout.strip()) == (0, NO_PRIVILEGE), (round, quit_)
        time.sleep(1.5)  # three health checks: a quit daemon would be seen down
        assert runc_env.running(daemon) and cluster.daemon_pid() == daemon, round
        assert cluster.card_health() == {"Healthy"}, round
        limit = cluster.control(tenant, "get_default_device_pinned_mem_limit 0")
        assert (limit.returncode, limit.stdout) == (0, "15G\n"), (round, limit)
        servers = cluster.control(tenant, "get_server_list")
        assert (servers.returncode, servers.stdout, servers.stderr) == (0, "", ""), round
        assert cluster.run_in(tenant, "ls -a /tmp/nvidia-mps").stdout.split() == [
            ".",
            "..",
            "control",
        ]
        tamper = cluster.run_in(tenant, "rm -f /tmp/nvidia-mps/control || exit 3")
        assert tamper.returncode == 3 and "Read-only file system" in tamper.stderr, round
        daemon = cluster.restart_daemon()


def test_a_container_posing_as_the_control_daemon_is_never_exempt(real_cluster):
    """Impostors in a shared container with the host's network: a script whose argv and
    env are those of the card's daemon, and NVIDIA's own binary (the host's file) started
    with `-d` on the card's host pipe path, so it holds a listening socket bound there.
    Whatever restarts the real daemon, gpushare-node verifies the real one only, and a
    GPU process under the script impostor is killed like any other."""
    cluster = real_cluster
    pipe = cluster.pipe_dir()
    forge = os.path.join(cluster.runtime.rootfs, "opt", "forge")
    os.makedirs(forge, exist_ok=True)
    with open(os.path.join(forge, "nvidia-cuda-mps-control"), "w") as f:
        f.write(IMPOSTOR)
    os.chmod(os.path.join(forge, "nvidia-cuda-mps-control"), 0o755)
    cluster.node.wait_for(lambda: cluster.daemon_pid() in cluster.ready_pids(), 20, "MPS ready")
    attacker = cluster.tenant("attacker", (host_network, scratch_at(cluster.node.root)))
    pose = ("env", f"CUDA_MPS_PIPE_DIRECTORY={pipe}", f"CUDA_VISIBLE_DEVICES={GPU0}")
    impostor = cluster.runtime.exec(attacker, *pose, "/opt/forge/nvidia-cuda-mps-control", "-d")
    assert cluster.run_in(attacker, f"mkdir -p {pipe}").returncode == 0
    cluster.runtime.exec(attacker, *pose, IN_CONTAINER_BINARY, "-d")
    listening = cluster.run_in(attacker, f"grep -c ' {pipe}/control$' /proc/net/unix").stdout
    assert int(listening) == 2  # the real daemon's and the impostor's, in one namespace
    # A crash of the real daemon: gpushare-node must identify it anew, with both impostors
    # running (started before it, they have the lower PIDs).
    real = cluster.restart_daemon()
    assert cluster.ready_pids()[-1] == real
    [child] = children(impostor)
    cluster.set_usage([(child, GPU0, 6000)])
    assert wait_gone(child, 5), "a process under the impostor was spared"
    assert "violation (memory)" in cluster.node.log()
    assert f"killed process {child}" in cluster.node.log()
    quit_ = cluster.control(attacker, "quit")  # the recipe's last step
    assert quit_.stdout.strip() == NO_PRIVILEGE
    time.sleep(1.5)  # three health checks
    assert cluster.daemon_pid() == real and cluster.ready_pids()[-1] == real
    assert cluster.card_health() == {"Healthy"}


def test_only_the_verified_daemons_servers_are_spared(standin_cluster):
    """An MPS server the card's daemon started (its child, running the server binary) is
    spared whatever memory it shows; the same server file run by anyone else, outside
    every container, is an unallocated GPU process and is killed."""
    cluster = standin_cluster
    pipe = cluster.pipe_dir()
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe}
    cluster.node.wait_for(lambda: cluster.daemon_pid() in cluster.ready_pids(), 20, "MPS ready")
    ask = [MPS_STANDIN]
    subprocess.run(ask, input="start_server -uid 0\n", env=env, text=True, check=True)
    answer = subprocess.run(ask, input="get_server_list\n", env=env, text=True, capture_output=True)
    server = int(answer.stdout)
    server_file = os.path.join(os.path.dirname(MPS_STANDIN), "nvidia-cuda-mps-server")
    # As the daemon starts its servers, but started by us: it lives while we do.
    lookalike = subprocess.Popen(
        ["nvidia-cuda-mps-server", server_file, str(os.getpid())], executable="/bin/sh"
    )
    try:
        cluster.set_usage([(server, GPU0, 8000), (lookalike.pid, GPU0, 100)])
        assert lookalike.wait(timeout=5) == -signal.SIGKILL
        time.sleep(1.5)  # more scans
        assert runc_env.running(server)
        assert f"killed process {server}" not in cluster.node.log()
    finally:
        if lookalike.poll() is None:
            lookalike.kill()
            lookalike.wait()
