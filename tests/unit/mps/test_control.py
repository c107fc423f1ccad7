"""Pins the MPS library's failure handling: a hung control binary is a timeout (its
whole process group killed), garbage is a protocol error, a missing binary names
the fix; probe() turns each into a health state and never raises."""

import os
import stat
import time

import psutil
import pytest

from mps import CardDaemon, ControlClient, HealthState, MpsProtocolError, MpsTimeout
from mps.control import MpsUnavailable


def script(tmp_path, body: str) -> str:
    path = tmp_path / "nvidia-cuda-mps-control"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def daemon(binary, tmp_path, timeout=1.0):
    return CardDaemon("GPU-x", binary, str(tmp_path / "pipe"), str(tmp_path / "log"), timeout)


def test_hung_binary_times_out_and_its_process_group_is_killed(tmp_path):
    pidfile = tmp_path / "child.pid"
    binary = script(tmp_path, f"sleep 30 & echo $! > {pidfile}; wait")
    started = time.monotonic()
    with pytest.raises(MpsTimeout, match="did not answer 'get_server_list' within 0.5 s"):
        ControlClient(binary, str(tmp_path), 0.5).server_pids()
    assert time.monotonic() - started < 3
    child = int(pidfile.read_text())

    def gone():
        try:
            return psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 5  # SIGKILL is delivered asynchronously
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone()
    assert daemon(binary, tmp_path, 0.5).probe().state is HealthState.HUNG


def test_garbage_answer_is_a_protocol_error_naming_the_answer(tmp_path):
    binary = script(tmp_path, "cat >/dev/null; echo 'segfault at 0x0 ???'")
    with pytest.raises(MpsProtocolError, match="unexpected answer to 'get_server_list'"):
        ControlClient(binary, str(tmp_path), 2).server_pids()
    health = daemon(binary, tmp_path).probe()
    assert health.state is HealthState.BROKEN and "segfault" in health.reason


def test_error_answer_is_a_protocol_error(tmp_path):
    binary = script(tmp_path, "cat >/dev/null; echo 'Error: unknown command foo'")
    with pytest.raises(MpsProtocolError, match="Error: unknown command"):
        ControlClient(binary, str(tmp_path), 2).command("foo")


def test_missing_binary_is_unavailable_with_the_fix(tmp_path):
    client = ControlClient(str(tmp_path / "absent"), str(tmp_path), 2)
    with pytest.raises(MpsUnavailable, match="set mps.control_binary"):
        client.server_pids()
    assert daemon(str(tmp_path / "absent"), tmp_path).probe().state is HealthState.DOWN


def test_no_daemon_is_down_with_what_the_binary_said(tmp_path):
    binary = script(tmp_path, "echo 'Cannot find MPS control daemon process' >&2; exit 1")
    health = daemon(binary, tmp_path).probe()
    assert health.state is HealthState.DOWN and "Cannot find MPS control daemon" in health.reason


def test_start_that_never_answers_is_reported_not_waited_on(tmp_path):
    # "-d" succeeds but nothing ever answers at the pipe directory.
    binary = script(tmp_path, '[ "$1" = "-d" ] && exit 0; exit 1')
    started = time.monotonic()
    with pytest.raises(MpsUnavailable, match="nothing answers"):
        daemon(binary, tmp_path, 0.5).start()
    assert time.monotonic() - started < 3
    assert os.path.isdir(tmp_path / "pipe") and os.path.isdir(tmp_path / "log")
