"""Pins standins.listeners: the /proc/net parsers on lines as the kernel writes them;
this process's own listeners found (a TCP port, a unix socket renamed after its bind known
by its file, a bound datagram socket, not a connected client); the listener table of a page
read by its columns, "as `other`" cells resolved, and a malformed table refused."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest

from standins import listeners


def test_inet_lines_are_read_as_the_kernel_writes_them():
    """Addresses in host-order words, ports in hex, the state and the inode."""
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
        "timeout inode\n"
        "   0: 0100007F:A005 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0 "
        "       0 4441811 1 00000000f06e9636 100 0 0 10 0\n"
    )
    assert listeners.parse_inet(text, v6=False) == [(4441811, "127.0.0.1", 40965, "0.0.0.0", 0, 10)]
    v6 = (
        "  sl  local_address                         remote_address                        st\n"
        "   0: 00000000000000000000000001000000:2475 00000000000000000000000000000000:0000 0A "
        "00000000:00000000 00:00000000 00000000     0        0 77 1\n"
    )
    assert listeners.parse_inet(v6, v6=True) == [(77, "::1", 9333, "::", 0, 10)]


def test_unix_and_netlink_lines_are_read_by_their_columns():
    """/proc/net/unix: flags, type, state by inode; /proc/net/netlink: protocol, groups."""
    unix = (
        "Num       RefCount Protocol Flags    Type St Inode Path\n"
        "00000000ee7a9e11: 00000002 00000000 00010000 0001 01 4940781 /tmp/x/.ab12/s\n"
        "000000001ed3336b: 00000003 00000000 00000000 0005 03 4941087\n"
    )
    assert listeners.parse_unix(unix) == {4940781: (0x10000, 1, 1), 4941087: (0, 5, 3)}
    netlink = (
        "sk               Eth Pid        Groups   Rmem     Wmem     Dump  Locks    Drops    "
        "Inode\n"
        "0000000088fe716b 11  18070      00000001 0        0        0     2        0        "
        "4959098\n"
    )
    assert listeners.parse_netlink(netlink) == {4959098: (11, 1)}


def test_this_process_s_listeners_are_found_and_its_clients_are_not():
    """A TCP listener on loopback, a unix listener bound in one directory and renamed into
    another (found by its file, not by the name it was bound at), a bound datagram socket;
    a connected client of the unix listener is a socket of a known kind, not a listener."""
    directory = tempfile.mkdtemp(prefix="ls", dir="/tmp")
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    datagram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.mkdir(os.path.join(directory, "staging"))
        unix.bind(os.path.join(directory, "staging", "s"))
        unix.listen()
        final = os.path.join(directory, "final.sock")
        os.rename(os.path.join(directory, "staging", "s"), final)
        datagram.bind(os.path.join(directory, "dgram.sock"))
        client.connect(final)
        found = listeners.sockets_of(os.getpid())
        where = {(item.kind, item.where) for item in found.listeners}
        assert ("tcp", ("127.0.0.1", tcp.getsockname()[1])) in where
        assert ("unix", listeners.file_key(final)) in where
        assert ("unix", listeners.file_key(os.path.join(directory, "dgram.sock"))) in where
        mine = {item.inode for item in found.listeners}
        client_inode = os.fstat(client.fileno()).st_ino
        assert client_inode not in mine and client_inode not in found.unknown
    finally:
        for sock in (tcp, unix, datagram, client):
            sock.close()


PAGE = """\
intro
<!-- BEGIN listeners (checked) -->
| listener | process and code | where | who can reach it | what they control | authentication | budget | tests |
|---|---|---|---|---|---|---|---|
| `a` | p: `x.py` | here | root only | all | mode | 8 connections | t |
| `b` | p | there | root only | some | as `a` | as `a`, but 1 KiB | t |
<!-- END listeners -->
"""  # noqa: E501


def test_the_table_is_read_by_its_columns_and_as_cells_resolved():
    """Rows by name, cells by column; "as `a`" replaced by a's cell, the rest kept."""
    rows = listeners.listener_table(PAGE)
    assert sorted(rows) == ["a", "b"]
    assert rows["a"]["process and code"] == "p: `x.py`"
    assert listeners.resolved(rows, "b", "budget") == "8 connections, but 1 KiB"
    assert listeners.resolved(rows, "b", "authentication") == "mode"


@pytest.mark.parametrize(
    ("page", "why"),
    [
        ("no table at all", "no listener table"),
        (PAGE.replace("| tests |\n", "|\n", 1), "columns are"),
        (PAGE.replace("| `b` |", "| b |"), "not of its form"),
        (PAGE.replace("| `b` |", "| `a` |"), "two rows"),
    ],
)
def test_a_table_not_of_its_form_is_refused(page, why):
    """No table, other columns, a name not in backticks, a name twice: each says so."""
    with pytest.raises(ValueError, match=why):
        listeners.listener_table(page)
