"""Pins mps.holders: /proc/PID/syscall is read as the kernel writes it (number and six
arguments; "running" or anything else is nothing); the fd a process is blocked on is the
first argument of a read- or write-family call of its architecture only; and a connection
holds the daemon only when two looks of the same running daemon show it, to the same peer,
the daemon blocked on it waiting for the client (reading with nothing unread, or writing
with the client's end full of what it did not read), held by a process that is neither the
node daemon's nor the control daemon's; a look that could not see everything judges
nobody."""

from __future__ import annotations

import pytest

from mps.holders import (
    READING,
    WRITING,
    Connection,
    Holder,
    Look,
    blocked_on,
    holding,
    parse_syscall,
    waiting,
)
from mps.identity import DaemonIdentity

DAEMON = DaemonIdentity(100, 5000)
TENANT = Holder(300, 7000)


def connection(
    fd=4, inode=10, peer=11, unread=0, blocked=READING, holders=(TENANT,), peer_unread=None
) -> Connection:
    return Connection(fd, inode, peer, unread, blocked, tuple(holders), peer_unread)


def look(*connections: Connection, daemon=DAEMON, stopped=False, problem=None) -> Look:
    return Look(daemon, stopped, connections, problem)


def test_syscall_is_its_number_and_arguments():
    """As the kernel writes it: number, six arguments, stack and program counter."""
    data = b"47 0x4 0x7ffc1d1cc420 0x40000000 0x7fce33b2cfc8 0x0 0x640 0x7ffc 0x7fce\n"
    assert parse_syscall(data) == (47, (4, 0x7FFC1D1CC420, 0x40000000, 0x7FCE33B2CFC8, 0, 0x640))


@pytest.mark.parametrize(
    "data",
    [b"running\n", b"-1 0x7ffc 0x7fce\n", b"", b"47 4 0x0\n", b"47 0xzz\n", b"4x7 0x1\n"],
)
def test_a_process_not_blocked_in_a_call_or_an_odd_line_has_no_syscall(data):
    """A running process, one outside a system call (-1) and what the kernel never
    writes give nothing."""
    assert parse_syscall(data) is None


def test_the_fd_blocked_on_is_a_read_or_write_calls_first_argument_on_a_known_architecture():
    """recvmsg(4, ...) on x86_64 reads fd 4, sendmsg(4, ...) writes it; poll, an unknown
    architecture or no call is blocked on nothing that can be named."""
    assert blocked_on((47, (4, 0, 0)), "x86_64") == (READING, 4)
    assert blocked_on((0, (9,)), "x86_64") == (READING, 9)  # read
    assert blocked_on((46, (4,)), "x86_64") == (WRITING, 4)  # sendmsg
    assert blocked_on((44, (5,)), "x86_64") == (WRITING, 5)  # sendto
    assert blocked_on((212, (4,)), "aarch64") == (READING, 4)  # recvmsg there
    assert blocked_on((211, (4,)), "aarch64") == (WRITING, 4)  # sendmsg there
    assert blocked_on((7, (0x3C059160, 3, 1000)), "x86_64") is None  # poll
    assert blocked_on((47, (4,)), "riscv64") is None
    assert blocked_on(None, "x86_64") is None


def test_a_connection_seen_waiting_at_two_looks_holds_the_daemon():
    """The same connection, to the same peer, the daemon blocked reading it with nothing
    unread, or writing to it with the client's end full, both times."""
    assert holding(look(connection()), look(connection())) == [connection()]
    assert waiting(look(connection())) == [connection()]
    full = connection(blocked=WRITING, peer_unread=9000)
    assert holding(look(full), look(full)) == [full]


@pytest.mark.parametrize(
    ("before", "after", "why"),
    [
        (None, look(connection()), "a first look alone"),
        (look(connection(peer=12)), look(connection()), "another peer since"),
        (look(connection(inode=9)), look(connection()), "another connection since"),
        (look(connection(blocked=None)), look(connection()), "not blocked on it before"),
        (look(connection()), look(connection(blocked=None)), "not blocked on it now"),
        (look(connection(blocked=WRITING)), look(connection(blocked=WRITING)), "client reads"),
        (
            look(connection(blocked=WRITING, peer_unread=0)),
            look(connection(blocked=WRITING, peer_unread=0)),
            "nothing left unread by the client",
        ),
        (look(connection()), look(connection(unread=9)), "the client sent something"),
        (look(connection()), look(connection(peer=None)), "the client closed it"),
        (look(connection()), look(connection(), stopped=True), "a stopped daemon"),
        (look(connection(), stopped=True), look(connection()), "stopped before"),
        (look(connection(), daemon=DaemonIdentity(100, 1)), look(connection()), "another daemon"),
        (look(connection()), look(connection(), problem="unreadable"), "an incomplete look"),
        (look(connection(), problem="unreadable"), look(connection()), "incomplete before"),
        (look(connection()), look(connection(holders=())), "nobody holds it"),
    ],
)
def test_no_hold_without_every_fact(before, after, why):
    """Each fact missing, nobody is judged."""
    assert holding(before, after) == [], why


def test_the_node_daemons_and_the_control_daemons_own_clients_never_hold_it():
    """Our own control commands (descendants of the node daemon) and the control daemon's
    processes are never acted on, not even beside another holder."""
    for own in (Holder(400, 1, ours=True), Holder(401, 1, daemons=True)):
        mine = connection(holders=(own,))
        assert holding(look(mine), look(mine)) == [] and waiting(look(mine)) == []
        shared = connection(holders=(TENANT, own))
        assert holding(look(shared), look(shared)) == []


def test_nothing_waits_on_a_stopped_daemon_or_in_an_incomplete_look():
    """``waiting`` (the candidates looked at again) follows the same rules."""
    assert waiting(look(connection(), stopped=True)) == []
    assert waiting(look(connection(), problem="unreadable")) == []
    assert waiting(look(connection(unread=3))) == []
