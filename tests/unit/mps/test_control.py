"""Pins the MPS library's failure handling: a hung control binary is a timeout (its
whole process group killed), garbage is a protocol error, a missing binary names
the fix; probe() turns each into a health state and never raises."""

import os
import stat
import time

import psutil
import pytest

from mps import CardDaemon, ControlClient, HealthState, MpsProtocolError, MpsTimeout
from mps.control import MpsUnavailable, MpsUnsupported


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


# The dialect of NVIDIA's real binary (driver 535, see docs/real-parts.md): errors are
# answers on stdout with exit status 0, limits read back in whole GiB, and quit's exit
# status is the daemon's own (non-zero when its servers did not exit gracefully).


def answering(tmp_path, answers: dict[str, str], otherwise: str = "") -> str:
    """A control binary whose answer depends on the command's first word (exit 0)."""
    cases = "".join(f"  {word}) printf '%s' '{text}' ;;\n" for word, text in answers.items())
    fallback = f"  *) printf '%s' '{otherwise}' ;;\n"
    return script(
        tmp_path, 'read -r line; set -- $line\ncase "$1" in\n' + cases + fallback + "esac"
    )


def test_unknown_command_with_exit_status_0_is_an_error(tmp_path):
    binary = answering(tmp_path, {}, 'Unknown command "frobnicate"\n')
    with pytest.raises(MpsUnsupported, match='Unknown command "frobnicate"'):
        ControlClient(binary, str(tmp_path), 2).command("frobnicate 3")


def test_pinned_limit_read_back_in_gib_counts_as_set(tmp_path):
    binary = answering(tmp_path, {"get_default_device_pinned_mem_limit": "4G\n"})
    ControlClient(binary, str(tmp_path), 2).set_default_pinned_mem_limit("0", 4096)


@pytest.mark.parametrize("shown", ["", "3G\n", "5G\n", "4095M\n"])
def test_pinned_limit_not_read_back_is_an_error(tmp_path, shown):
    binary = answering(tmp_path, {"get_default_device_pinned_mem_limit": shown})
    with pytest.raises(MpsProtocolError, match="pinned memory limit"):
        ControlClient(binary, str(tmp_path), 2).set_default_pinned_mem_limit("0", 4096)


def test_pinned_limit_set_answering_text_is_an_error(tmp_path):
    binary = answering(tmp_path, {"set_default_device_pinned_mem_limit": "Not allowed\n"})
    with pytest.raises(MpsProtocolError, match="Not allowed"):
        ControlClient(binary, str(tmp_path), 2).set_default_pinned_mem_limit("0", 4096)


@pytest.mark.parametrize(
    ("shown", "mib"), [("4G", 4096), ("15G", 15360), ("1G", 1024), ("512M", 512), ("", None)]
)
def test_pinned_limit_is_read_in_mib_as_shown(tmp_path, shown, mib):
    binary = answering(tmp_path, {"get_default_device_pinned_mem_limit": shown + "\n"})
    assert ControlClient(binary, str(tmp_path), 2).default_pinned_mem_limit_mib("0") == mib


def test_refused_thread_percentage_answering_the_kept_value_is_an_error(tmp_path):
    binary = answering(tmp_path, {"set_default_active_thread_percentage": "25.0\n"})
    client = ControlClient(binary, str(tmp_path), 2)
    with pytest.raises(MpsProtocolError, match="kept 25.0"):
        client.set_default_active_thread_percentage(250)
    client.set_default_active_thread_percentage(25)


def test_thread_percentage_is_read(tmp_path):
    binary = answering(tmp_path, {"get_default_active_thread_percentage": "33.3\n"})
    assert ControlClient(binary, str(tmp_path), 2).default_active_thread_percentage() == 33.3


def test_quit_refused_with_exit_status_0_is_an_error(tmp_path):
    binary = answering(tmp_path, {"quit": "Not enough privilege to execute quit command\n"})
    with pytest.raises(MpsProtocolError, match="Not enough privilege"):
        ControlClient(binary, str(tmp_path), 2).quit()


def test_quit_with_exit_status_1_stops_a_daemon_that_then_is_gone(tmp_path):
    # The daemon "exits with status 1" (a server did not exit gracefully); gone after quit.
    flag = tmp_path / "running"
    flag.touch()
    binary = script(
        tmp_path,
        f'read -r line; [ -e {flag} ] || {{ echo "Cannot find MPS control daemon process" >&2; '
        f'exit 1; }}; [ "$line" = quit ] && {{ rm {flag}; exit 1; }}; exit 0',
    )
    card = daemon(binary, tmp_path)
    assert card.probe().ok
    card.stop()
    assert card.probe().state is HealthState.DOWN


def test_driver_without_get_server_status_is_healthy_with_servers(tmp_path):
    binary = answering(
        tmp_path,
        {"get_server_list": "4242\n", "get_client_list": "7\n8\n"},
        'Unknown command "get_server_status"\n',
    )
    health = daemon(binary, tmp_path).probe()
    assert (health.state, health.servers, health.clients) == (HealthState.HEALTHY, 1, 2)


def test_server_gone_between_list_and_client_list_has_no_clients(tmp_path):
    binary = answering(
        tmp_path,
        {"get_server_list": "4242\n", "get_server_status": "ACTIVE\n"},
        "Server 4242 not found\n",
    )
    health = daemon(binary, tmp_path).probe()
    assert (health.state, health.servers, health.clients) == (HealthState.HEALTHY, 1, 0)
