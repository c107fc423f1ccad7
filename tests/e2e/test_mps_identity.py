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
import signal
import subprocess
import time

import pytest

from standins import real_parts, runc_env
from standins.daemon_proc import GPU0, MPS_STANDIN
from standins.mps_tenant import (
    NO_PRIVILEGE,
    MpsNode,
    children,
)

pytestmark = pytest.mark.e2e


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
    attacker, impostor = cluster.pose_as_daemon()
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
