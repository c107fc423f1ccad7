"""Pins nodemgr.common.connbudget.ConnectionBudget: at most ``max_connections`` enter at
once, one over is refused and counted under "cap" (logged once per burst, and the end of
the burst once); a connection still open at its deadline is shut down, counted under
"deadline" and known as cut until it is forgotten; one forgotten is never touched; other
refusals are counted by reason and an unknown reason is a bug; the stats say it all; and
the deadline thread sleeps without a timer while no connection is open."""

import logging
import socket
import time

import pytest

from nodemgr.common.connbudget import REASONS, ConnectionBudget
from standins.threadstats import wakeups_while_idle


@pytest.fixture
def budget():
    budget = ConnectionBudget("test-listener", 2, 0.3)
    budget.start()
    yield budget
    budget.stop()
    budget.join(2)


def pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair()


def test_the_cap_admits_that_many_and_counts_the_rest_once_logged(budget, caplog):
    """Two enter, the third and fourth are refused (one warning for the burst); after one
    leaves, the next enters and the end of the burst is logged once."""
    socks = [pair() for _ in range(5)]
    with caplog.at_level(logging.INFO):
        assert [budget.enter(s) for s, _ in socks[:4]] == [True, True, False, False]
        budget.forget(socks[0][0])
        budget.leave()
        assert budget.enter(socks[4][0]) is True
    assert budget.refused("cap") == 2 and budget.connections == 2
    messages = [r.getMessage() for r in caplog.records]
    assert sum("connection cap" in m for m in messages) == 1
    assert sum("closed 2 connections over the cap of 2" in m for m in messages) == 1
    for a, b in socks:
        a.close()
        b.close()


def test_a_connection_open_at_its_deadline_is_shut_down_and_known_as_cut(budget):
    """The deadline thread shuts the socket down (a blocked recv returns b""), counts it,
    and ``was_cut`` says so until the socket is forgotten."""
    ours, theirs = pair()
    assert budget.enter(ours)
    started = time.monotonic()
    ours.settimeout(5)
    assert ours.recv(10) == b""  # ended by the shutdown, not by the peer
    assert 0.25 <= time.monotonic() - started < 2.0
    assert budget.refused("deadline") == 1 and budget.was_cut(ours)
    budget.forget(ours)
    assert not budget.was_cut(ours)
    budget.leave()
    ours.close()
    theirs.close()


def test_a_forgotten_connection_is_never_cut(budget):
    ours, theirs = pair()
    assert budget.enter(ours)
    budget.forget(ours)
    budget.leave()
    time.sleep(0.5)
    theirs.sendall(b"x")
    ours.settimeout(1)
    assert ours.recv(10) == b"x"  # still usable: never shut down
    assert budget.refused("deadline") == 0
    ours.close()
    theirs.close()


def test_refusals_are_counted_by_reason_and_stats_say_it_all(budget):
    budget.refuse("slow")
    budget.refuse("too_large")
    budget.refuse("too_large")
    with pytest.raises(ValueError, match="unknown refusal reason"):
        budget.refuse("bored")
    assert budget.stats() == {
        "connections": 0,
        "max_connections": 2,
        "deadline_seconds": 0.3,
        "refused": {reason: {"slow": 1, "too_large": 2}.get(reason, 0) for reason in REASONS},
    }


def test_the_deadline_thread_sleeps_without_a_timer_while_nothing_is_open(budget):
    ours, theirs = pair()
    assert budget.enter(ours)
    budget.forget(ours)
    budget.leave()
    time.sleep(0.5)  # past the deadline it was armed for
    assert wakeups_while_idle(budget._thread) == 0
    ours.close()
    theirs.close()


def test_a_budget_needs_a_cap_and_a_deadline():
    with pytest.raises(ValueError, match="needs a cap"):
        ConnectionBudget("x", 0, 1.0)
    with pytest.raises(ValueError, match="needs a cap"):
        ConnectionBudget("x", 1, 0.0)
