"""The systemd notify protocol (nodemgr.runtime.notify) against a real AF_UNIX datagram socket.

Pins: messages arrive as newline-separated KEY=VALUE datagrams at a path or an
abstract ('@') NOTIFY_SOCKET; RELOADING=1 carries MONOTONIC_USEC; STATUS is one
line and is sent only when it changed; WATCHDOG=1 only when WATCHDOG_USEC is set
for this PID, at most every half interval; without NOTIFY_SOCKET, or with the
socket gone, nothing is raised.
"""

from __future__ import annotations

import os
import time

import pytest

from nodemgr.runtime.notify import ServiceNotifier
from standins.notify_listener import Listener


@pytest.fixture(params=[False, True], ids=["path", "abstract"])
def listener(request):
    listener = Listener(abstract=request.param)
    yield listener
    listener.close()


def test_ready_status_reloading_stopping(listener):
    notifier = ServiceNotifier({"NOTIFY_SOCKET": listener.address})
    assert notifier.enabled
    notifier.ready("serving 3 resources\non 2 GPUs")
    notifier.reloading()
    before_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.stopping()
    ready, reloading, stopping = listener.messages()
    assert ready == {"READY": "1", "STATUS": "serving 3 resources on 2 GPUs"}
    assert reloading["RELOADING"] == "1" and reloading["STATUS"] == "reloading"
    assert 0 < int(reloading["MONOTONIC_USEC"]) <= before_us
    assert stopping == {"STOPPING": "1", "STATUS": "stopping"}


def test_status_only_when_changed(listener):
    notifier = ServiceNotifier({"NOTIFY_SOCKET": listener.address})
    for text in ("waiting for kubelet", "waiting for kubelet", "serving", "serving"):
        notifier.status(text)
    assert [m["STATUS"] for m in listener.messages()] == ["waiting for kubelet", "serving"]


def test_watchdog_pings_at_half_interval(listener):
    notifier = ServiceNotifier(
        {
            "NOTIFY_SOCKET": listener.address,
            "WATCHDOG_USEC": "400000",
            "WATCHDOG_PID": str(os.getpid()),
        }
    )
    assert notifier.watchdog_interval_seconds == 0.4
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        notifier.watchdog()
        time.sleep(0.01)
    pings = [m for m in listener.messages() if m == {"WATCHDOG": "1"}]
    assert 4 <= len(pings) <= 6  # one per 0.2 s, not one per call


@pytest.mark.parametrize(
    "environ",
    [
        {},  # no watchdog configured
        {"WATCHDOG_USEC": "0"},
        {"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"},  # meant for another process
        {"WATCHDOG_USEC": "soon"},
    ],
)
def test_no_watchdog_pings_when_not_ours(listener, environ):
    notifier = ServiceNotifier({"NOTIFY_SOCKET": listener.address, **environ})
    assert notifier.watchdog_interval_seconds is None
    notifier.watchdog()
    notifier.status("marker")  # datagrams arrive in order: a ping would come first
    listener.sock.settimeout(5)
    assert listener.sock.recv(4096) == b"STATUS=marker"


def test_without_systemd_nothing_happens():
    notifier = ServiceNotifier({})
    assert not notifier.enabled
    notifier.ready("x")
    notifier.watchdog()


def test_socket_gone_is_not_fatal(caplog):
    listener = Listener()
    notifier = ServiceNotifier({"NOTIFY_SOCKET": listener.address})
    listener.close()
    os.unlink(listener.address)
    notifier.ready("x")
    notifier.status("y")
    warnings = [r for r in caplog.records if "cannot notify systemd" in r.getMessage()]
    assert len(warnings) == 1  # said once, not at every message


def test_missing_socket_at_start_is_not_fatal(caplog):
    notifier = ServiceNotifier({"NOTIFY_SOCKET": "/tmp/gs-no-such-dir/notify.sock"})
    assert not notifier.enabled
    notifier.ready("x")
    assert "cannot reach systemd" in caplog.text


def test_status_is_sent_as_utf8_even_beyond_latin1(listener):
    """A STATUS naming a pod with a non-Latin-1 name reaches systemd as UTF-8 (the sdnotify
    package would encode Latin-1 and drop such a message silently)."""
    notifier = ServiceNotifier({"NOTIFY_SOCKET": listener.address})
    notifier.status("refused pod ml/训练-0 on GPU0")
    assert listener.messages() == [{"STATUS": "refused pod ml/训练-0 on GPU0"}]
