"""Pins standins/exitwait.py: a child's exit is met when it happens, never by a
sleep-and-check loop (which put every runc timing of the benchmarks on 31 or 63 ms)."""

import subprocess
import sys
import time

import pytest

from standins import exitwait

SLEEP_20_MS = [sys.executable, "-I", "-S", "-c", "import time; time.sleep(0.02)"]


@pytest.fixture
def sleeps(monkeypatch):
    """Every time.sleep call made while the test runs (subprocess's wait loop uses it)."""
    made: list[float] = []
    real_sleep = time.sleep

    def counting_sleep(seconds):
        made.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", counting_sleep)
    return made


def test_subprocess_run_with_a_timeout_polls_the_child(sleeps):
    """The hole this module closes: subprocess.run(timeout=...) sleeps in steps of 1, 2, 4,
    8, 16 ms... between checks, so a 20 ms child is seen only at the next step."""
    subprocess.run(SLEEP_20_MS, stdout=subprocess.DEVNULL, timeout=30)
    assert len(sleeps) >= 3
    assert sleeps[:3] == [0.001, 0.002, 0.004]


def test_run_returns_at_the_exit_without_sleeping(sleeps):
    """exitwait.run waits for the same child without a single sleep."""
    done = exitwait.run(SLEEP_20_MS, stdout=subprocess.DEVNULL, timeout=30)
    assert done.returncode == 0
    assert sleeps == []


def test_run_passes_input_and_captures_output():
    """input goes to the child's stdin; capture_output gives back stdout, stderr and the status."""
    echo = [sys.executable, "-I", "-S", "-c",
            "import sys; d = sys.stdin.read(); print(d.upper()); print('e', file=sys.stderr); "
            "sys.exit(3)"]  # fmt: skip
    done = exitwait.run(echo, input=b"spec", capture_output=True, timeout=30)
    assert (done.returncode, done.stdout.strip(), done.stderr.strip()) == (3, b"SPEC", b"e")


def test_run_kills_a_child_past_its_timeout():
    """Past the timeout the child is killed and TimeoutExpired raised, as subprocess.run does."""
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        exitwait.run([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.3)
    assert time.monotonic() - started < 10


def test_wait_for_exit_times_out_and_leaves_the_child_running(sleeps):
    """wait_for_exit raises TimeoutExpired with the child still running, then returns its
    status once it exits, without polling."""
    child = subprocess.Popen([sys.executable, "-I", "-S", "-c", "import time; time.sleep(0.5)"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            exitwait.wait_for_exit(child, timeout=0.05)
        assert child.poll() is None
        assert exitwait.wait_for_exit(child, timeout=30) == 0
        assert exitwait.wait_for_exit(child, timeout=30) == 0  # already reaped: same status
        assert sleeps == []
    finally:
        child.kill()
        child.wait()


def test_run_checks_the_status_when_asked():
    """check=True raises CalledProcessError for a non-zero status, as subprocess.run does;
    text=True gives str output."""
    fail = [sys.executable, "-I", "-S", "-c", "print('out'); raise SystemExit(2)"]
    with pytest.raises(subprocess.CalledProcessError) as raised:
        exitwait.run(fail, capture_output=True, text=True, check=True, timeout=30)
    assert (raised.value.returncode, raised.value.stdout) == (2, "out\n")
