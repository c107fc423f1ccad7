"""Pins the pure judging of which process is a card's MPS control daemon and which are its
servers (mps.identity): /proc/net/unix lines read as the kernel writes them (a forged line
can add a claim, never remove one), /proc fields that are not the kernel's refused, the
file a process runs told by identity (not by name), the daemon chosen only when one
process stands out, and servers only among its direct children."""

from __future__ import annotations

import pytest

from mps.identity import (
    Candidate,
    Child,
    DaemonIdentity,
    Executable,
    FileId,
    Stat,
    choose_daemon,
    choose_servers,
    environ_path,
    is_script,
    listening_inodes,
    parse_children,
    parse_stat,
    parse_uids,
    runs,
    search_path,
    socket_inode,
)

PIPE = b"/run/gpushare/mps/GPU-a/pipe/control"
HEADER = b"Num       RefCount Protocol Flags    Type St Inode Path\n"


def unix_line(inode: int, path: bytes = b"", flags: str = "00010000", state: str = "01") -> bytes:
    """A /proc/net/unix line as the kernel prints it (inode right-aligned in 5 columns)."""
    tail = b" " + path if path else b""
    return b"0000000000000000: 00000002 00000000 %s 0005 %s %5d%s\n" % (
        flags.encode(),
        state.encode(),
        inode,
        tail,
    )


def test_listening_sockets_at_exactly_the_path_are_found():
    """Only sockets listening (flag __SO_ACCEPTCON, state unconnected) at exactly the
    path count: not a connected or unbound one, not another path or a longer one."""
    lines = [
        HEADER,
        unix_line(101, PIPE),
        unix_line(102, PIPE + b"_privileged"),
        unix_line(103, PIPE, flags="00000000"),  # bound, never listened
        unix_line(104, PIPE, state="03"),  # connected
        unix_line(105),  # unbound client
        unix_line(106, b"/elsewhere" + PIPE),
        unix_line(7, PIPE),  # a short inode number, padded
    ]
    assert listening_inodes(lines, PIPE) == {101, 7}


def test_a_path_with_spaces_or_bytes_that_are_not_utf8_is_compared_as_bytes():
    """A path is compared byte for byte: spaces and non-UTF-8 bytes are part of it."""
    odd = b"/run/g s/\xff/control"
    assert listening_inodes([unix_line(5, odd)], odd) == {5}
    assert listening_inodes([unix_line(5, odd)], b"/run/g s/") == set()


def test_a_forged_line_in_a_path_can_add_a_claim_but_never_remove_one():
    """A socket bound at a path holding a newline prints a second line of the binder's
    choosing: it may claim another inode listens here (which the process checks then
    reject), but the real daemon's line still counts."""
    forged = b"x\n" + unix_line(999, PIPE).rstrip(b"\n")
    raw = HEADER + unix_line(101, PIPE) + unix_line(500, forged)
    assert listening_inodes(raw.splitlines(keepends=True), PIPE) == {101, 999}


@pytest.mark.parametrize(
    "line",
    [
        b"garbage\n",
        b"0000000000000000: 00000002 00000000 00010000 0005 01\n",  # no inode
        b"0000000000000000: 00000002 00000000 0001000 0005 01 101 " + PIPE + b"\n",
        b"0000000000000000: 00000002 00000000 00010000 0005 01 1" + b"0" * 21 + b" " + PIPE,
        b"",
    ],
)
def test_malformed_lines_are_skipped(line):
    """A line not in the kernel's format (short field, no inode, a number longer than 64
    bits, nothing) claims nothing."""
    assert listening_inodes([line, unix_line(101, PIPE)], PIPE) == {101}


def test_socket_links_are_read_strictly():
    """Only `socket:[N]` names a socket; other fd links and look-alikes do not."""
    assert socket_inode("socket:[1394132]") == 1394132
    for link in ("/tmp/socket:[1]", "socket:[]", "socket:[1a]", "pipe:[1]", "socket:[1] "):
        assert socket_inode(link) is None


def test_stat_is_split_after_the_last_parenthesis():
    """A process named `a) R 1 2 (` cannot shift the fields: they follow the last ')'."""
    fields = b" ".join([b"S", b"77"] + [b"0"] * 17 + [b"123456"] + [b"0"] * 30)
    assert parse_stat(b"42 (a) R 1 2 () " + fields) == Stat("S", 77, 123456)


@pytest.mark.parametrize(
    "data",
    [b"", b"42 (x) S 1", b"42 (x) SS " + b"1 " * 30, b"42 (x) S -1 " + b"1 " * 30, b"no paren"],
)
def test_malformed_stat_is_refused(data):
    """Too few fields, a state that is not one letter, a parent that is not a number."""
    assert parse_stat(data) is None


def test_uids_are_the_four_of_the_uid_line():
    """Real, effective, saved and file system uid; a missing or malformed line is None."""
    assert parse_uids(b"Name:\tx\nUid:\t0\t1000\t0\t0\nGid:\t0\t0\t0\t0\n") == (0, 1000, 0, 0)
    assert parse_uids(b"Name:\tx\n") is None
    assert parse_uids(b"Uid:\t0\t0\t0\n") is None
    assert parse_uids(b"Uid:\t0\t0\t0\t-1\n") is None


def test_children_are_space_separated_pids():
    assert parse_children(b"12 345 ") == [12, 345]
    assert parse_children(b"") == []
    assert parse_children(b"12 x") is None


def test_environ_path_is_the_first_path_entry():
    """As getenv() sees it: the first PATH= entry; unset, or not UTF-8, is None."""
    assert environ_path(b"A=1\0PATH=/usr/sbin:/usr/bin\0PATH=/evil\0") == "/usr/sbin:/usr/bin"
    assert environ_path(b"A=1\0MYPATH=/x\0") is None
    assert environ_path(b"PATH=/\xff\0") is None


def test_search_path_is_where_execlp_looks():
    """PATH entries in order; glibc's default without PATH; relative and empty entries
    (the daemon's working directory) are left out."""
    name = "nvidia-cuda-mps-server"
    assert search_path("/usr/sbin:/usr/bin", name) == [f"/usr/sbin/{name}", f"/usr/bin/{name}"]
    assert search_path(None, name) == [f"/bin/{name}", f"/usr/bin/{name}"]
    assert search_path(":bin:/opt", name) == [f"/opt/{name}"]


def test_is_script_looks_at_the_first_two_bytes():
    assert is_script(b"#!/bin/sh\n") and not is_script(b"\x7fELF") and not is_script(b"")


BINARY = Executable("/usr/bin/nvidia-cuda-mps-control", FileId(1, 10), script=False)
SCRIPT = Executable("/opt/fakes/nvidia-cuda-mps-control", FileId(1, 20), script=True)


def test_a_binary_is_run_by_its_file_not_its_name():
    """The exe's identity decides; a link reading the right path is not enough (a
    container's own copy reads so too), except "<path> (deleted)": the file replaced by
    an upgrade since the process started."""
    assert runs(FileId(1, 10), "/usr/bin/nvidia-cuda-mps-control", (), BINARY)
    assert not runs(FileId(2, 10), "/usr/bin/nvidia-cuda-mps-control", (), BINARY)
    assert runs(None, "/usr/bin/nvidia-cuda-mps-control (deleted)", (), BINARY)
    assert not runs(None, "/usr/bin/nvidia-cuda-mps-control", (), BINARY)
    assert not runs(FileId(9, 9), None, {FileId(1, 10)}, BINARY)  # holding it open: no


def test_a_script_is_run_by_the_process_holding_it_open():
    """The kernel names a script's interpreter as its exe: the script file held open by
    the process is what shows it runs it."""
    interpreter = FileId(5, 5)
    assert runs(interpreter, "/usr/bin/python3.11", {FileId(1, 20)}, SCRIPT)
    assert not runs(interpreter, "/usr/bin/python3.11", {FileId(1, 21)}, SCRIPT)


def test_the_one_candidate_is_the_daemon():
    assert choose_daemon([Candidate(40, 1, 400)]) == DaemonIdentity(40, 400)
    assert choose_daemon([]) is None


def test_a_fork_of_the_daemon_holding_its_sockets_does_not_hide_it():
    """A child of the daemon before its exec holds the sockets too: its parent is the daemon."""
    candidates = [Candidate(41, 40, 401), Candidate(40, 1, 400)]
    assert choose_daemon(candidates) == DaemonIdentity(40, 400)


def test_two_unrelated_candidates_are_no_daemon():
    """Two processes that each pass and neither is the other's parent: None (fail closed)."""
    assert choose_daemon([Candidate(40, 1, 400), Candidate(50, 1, 500)]) is None
    assert (
        choose_daemon([Candidate(40, 1, 400), Candidate(41, 40, 4), Candidate(42, 41, 4)]) is None
    )


def test_the_daemon_verified_before_stays_while_it_passes():
    """The previous daemon keeps its place against a newcomer; a previous identity whose
    process no longer passes (gone, or its PID reused: another start time) is dropped."""
    candidates = [Candidate(40, 1, 400), Candidate(50, 1, 500)]
    assert choose_daemon(candidates, DaemonIdentity(40, 400)) == DaemonIdentity(40, 400)
    assert choose_daemon([Candidate(40, 1, 999)], DaemonIdentity(40, 400)) == DaemonIdentity(
        40, 999
    )


def test_servers_are_live_direct_children_running_the_server_in_our_namespace():
    """Of the daemon's children only those running the server binary, alive, in our mount
    namespace; a grandchild (or anything whose parent is another) is never one."""
    daemon = DaemonIdentity(40, 400)
    children = [
        Child(41, 40, 410, zombie=False, runs_server=True, in_daemon_mount_ns=True),
        Child(42, 40, 420, zombie=False, runs_server=False, in_daemon_mount_ns=True),
        Child(43, 40, 430, zombie=True, runs_server=True, in_daemon_mount_ns=True),
        Child(44, 40, 440, zombie=False, runs_server=True, in_daemon_mount_ns=False),
        Child(45, 41, 450, zombie=False, runs_server=True, in_daemon_mount_ns=True),
    ]
    assert choose_servers(daemon, children) == {(41, 410)}
