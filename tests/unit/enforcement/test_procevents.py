"""Pins the netlink process connector reader: exec and exit events of real processes, and
``wake`` ending a blocked read at once (a stop must not wait out the read's timeout).
Needs root (CAP_NET_ADMIN) and CONFIG_PROC_EVENTS; skipped with the reason otherwise."""

import struct
import subprocess
import sys
import threading

import pytest

from nodemgr.enforcement.procevents import (
    PROC_EVENT_EXEC,
    PROC_EVENT_EXIT,
    ProcEvents,
    ProcEventsUnavailable,
    parse_datagram,
)


@pytest.fixture
def events():
    try:
        source = ProcEvents()
    except ProcEventsUnavailable as e:
        pytest.skip(str(e))
    yield source
    source.close()


def test_exec_and_exit_of_a_real_process_are_reported(events):
    """A child that execs and exits shows up in execs and exits by its PID."""
    child = subprocess.Popen(["true"])
    child.wait()
    seen_exec, seen_exit = set(), set()
    for _ in range(50):
        news = events.read(0.2)
        seen_exec |= news.execs
        seen_exit |= news.exits
        if child.pid in seen_exec and child.pid in seen_exit:
            break
    assert child.pid in seen_exec and child.pid in seen_exit


def test_wake_ends_a_blocked_read_at_once(events):
    """A read waiting 30 s returns (with no events) as soon as another thread wakes it."""
    returned = threading.Event()
    results = []

    def reader():
        results.append(events.read(30))
        returned.set()

    thread = threading.Thread(target=reader)
    thread.start()
    events.wake()
    assert returned.wait(5), "the read did not return after wake()"
    thread.join()


def test_wake_after_close_does_nothing(events):
    """A late wake from a stopping watchdog never writes into a closed (reused) descriptor."""
    events.read(0)  # (close itself is pinned by test_close_returns_on_a_quiet_node)
    events.close()
    events.wake()
    events.close()  # twice is fine too


def test_close_returns_on_a_quiet_node():
    """Closing a reader that saw no event returns at once (pyroute2's control(listen=False)
    waited for a reply that a quiet node never sends, which hung the watchdog's stop). Run
    in a child process so that a hang fails this test instead of the whole run."""
    code = (
        "from nodemgr.enforcement.procevents import ProcEvents, ProcEventsUnavailable\n"
        "try:\n    e = ProcEvents()\nexcept ProcEventsUnavailable:\n    raise SystemExit(3)\n"
        "e.close()\nprint('closed')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    if done.returncode == 3:
        pytest.skip("no netlink process connector here")
    assert done.returncode == 0 and "closed" in done.stdout, done.stderr


def _event(what: int, *fields: int) -> bytes:
    """One netlink message as the kernel sends it: nlmsghdr, cn_msg, proc_event."""
    body = struct.pack("=IIQ", what, 0, 123456789) + struct.pack(f"={len(fields)}I", *fields)
    cn = struct.pack("=IIIIHH", 1, 1, 0, 0, len(body), 0) + body
    return struct.pack("=IHHII", 16 + len(cn), 3, 0, 0, 0) + cn


def test_a_datagram_of_several_events_is_parsed_without_pyroute2():
    """exec of 100, exit of a thread (pid 201 of tgid 200: not a process exit), exit of 300,
    a fork (ignored) and a trailing short fragment (ignored, not a crash) in one datagram."""
    data = (
        _event(PROC_EVENT_EXEC, 100, 100)
        + _event(PROC_EVENT_EXIT, 201, 200, 0, 17)
        + _event(PROC_EVENT_EXIT, 300, 300, 0, 17)
        + _event(0x1, 1, 1, 400, 400)
        + b"\x01\x02"
    )
    execs, exits = parse_datagram(data)
    assert execs == {100} and exits == {300}


@pytest.mark.parametrize("data", [b"", b"\x00" * 15, struct.pack("=IHHII", 4, 3, 0, 0, 0)])
def test_truncated_or_malformed_datagrams_give_no_events(data):
    """A length field shorter than a header or past the end stops the parse quietly."""
    assert parse_datagram(data) == (set(), set())


def test_the_reader_does_not_import_pyroute2():
    """pyroute2 costs ~22 MiB and 310 modules in the daemon; the reader needs only struct."""
    code = (
        "import sys\nimport nodemgr.enforcement.procevents\n"
        "print(any(m.startswith('pyroute2') for m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
