"""Pins the netlink process connector reader: exec and exit events of real processes,
``wake`` ending a blocked read at once (a stop must not wait out the read's timeout), and
the socket filter that has the kernel drop every event but exec and a process's exit
(run through a classic-BPF interpreter here, and live: thread events never reach a read).
Needs root (CAP_NET_ADMIN) and CONFIG_PROC_EVENTS; skipped with the reason otherwise."""

import logging
import struct
import subprocess
import sys
import threading
import time

import pytest

from nodemgr.enforcement.procevents import (
    _CN_MSG,
    _EVENT_HEAD,
    _NLMSGHDR,
    PROC_EVENT_EXEC,
    PROC_EVENT_EXIT,
    Events,
    ProcEvents,
    ProcEventsUnavailable,
    parse_datagram,
    proc_event_filter,
)


@pytest.fixture
def events():
    try:
        source = ProcEvents()
    except ProcEventsUnavailable as e:
        pytest.skip(str(e))
    yield source
    source.close()


def exec_and_exit_seen(events, pid: int) -> bool:
    """Whether ``pid``'s exec and exit both reach ``events.read`` within ~10 s."""
    seen_exec, seen_exit = set(), set()
    for _ in range(50):
        news = events.read(0.2)
        seen_exec |= news.execs
        seen_exit |= news.exits
        if pid in seen_exec and pid in seen_exit:
            return True
    return False


def test_exec_and_exit_of_a_real_process_are_reported(events):
    """A child that execs and exits shows up in execs and exits by its PID, with the kernel
    filter attached (the default)."""
    assert events.filtered
    child = subprocess.Popen(["/bin/true"])
    child.wait()
    assert exec_and_exit_seen(events, child.pid)


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


# -- the kernel-side filter ------------------------------------------------------------
# Opcodes of linux/filter.h, written out here (not imported) so that a wrong constant in
# the module is caught rather than shared.
_LD_W_ABS, _LD_H_ABS, _LD_B_ABS, _LD_W_LEN = 0x20, 0x28, 0x30, 0x80
_ALU_ADD_K, _ALU_OR_X, _ALU_AND_K, _ALU_LSH_K = 0x04, 0x4C, 0x54, 0x64
_TAX, _RET_K = 0x07, 0x06
_JEQ_K, _JEQ_X, _JGT_X, _JGE_K = 0x15, 0x1D, 0x2D, 0x35
_U32 = 0xFFFFFFFF
_LOAD_BYTES = {_LD_W_ABS: 4, _LD_H_ABS: 2, _LD_B_ABS: 1}
_ALU = {
    _ALU_ADD_K: lambda a, x, k: (a + k) & _U32,
    _ALU_OR_X: lambda a, x, k: a | x,
    _ALU_AND_K: lambda a, x, k: a & k,
    _ALU_LSH_K: lambda a, x, k: (a << k) & _U32,
}
_JUMPS = {
    _JEQ_K: lambda a, x, k: a == k,
    _JEQ_X: lambda a, x, k: a == x,
    _JGT_X: lambda a, x, k: a > x,
    _JGE_K: lambda a, x, k: a >= k,
}


def run_classic_bpf(program, packet: bytes) -> int:
    """What the kernel's socket filter returns for ``packet`` (bytes kept; 0 drops it), for
    the opcodes the filter uses, under the kernel's rules: loads read network (big-endian)
    order and a load past the end drops the packet."""
    a = x = pc = 0
    while True:
        assert 0 <= pc < len(program), f"the program ran off its end at {pc}"
        code, jt, jf, k = program[pc]
        pc += 1
        if code == _RET_K:
            return k
        if code == _LD_W_LEN:
            a = len(packet)
        elif code in _LOAD_BYTES:
            if k + _LOAD_BYTES[code] > len(packet):
                return 0
            a = int.from_bytes(packet[k : k + _LOAD_BYTES[code]], "big")
        elif code == _TAX:
            x = a
        elif code in _ALU:
            a = _ALU[code](a, x, k)
        elif code in _JUMPS:
            pc += jt if _JUMPS[code](a, x, k) else jf
        else:
            raise AssertionError(f"opcode {code:#x} is not one this interpreter knows")


def _in_order(layout: struct.Struct, byteorder: str) -> struct.Struct:
    """The module's layout, packed in the given byte order instead of the host's."""
    return struct.Struct(("<" if byteorder == "little" else ">") + layout.format[1:])


def _message(what, *fields, byteorder=sys.byteorder, idx=1, val=1, nl_type=3) -> bytes:
    """One netlink message the size the kernel sends: nlmsghdr, cn_msg, and a proc_event
    (what, cpu, timestamp, then 24 bytes of event data starting with ``fields``)."""
    order = "<" if byteorder == "little" else ">"
    data = struct.pack(f"{order}{len(fields)}I", *fields).ljust(24, b"\0")
    body = _in_order(_EVENT_HEAD, byteorder).pack(what, 5, 123456789) + data
    cn = _in_order(_CN_MSG, byteorder).pack(idx, val, 7, 0, len(body), 0) + body
    head = _in_order(_NLMSGHDR, byteorder)
    return head.pack(head.size + len(cn), nl_type, 0, 0, 0) + cn


_FORK, _UID, _GID, _SID, _PTRACE, _COMM = 0x1, 0x4, 0x40, 0x80, 0x100, 0x200
_COREDUMP, _NONE = 0x40000000, 0x0


def _filter_cases(byteorder):
    """(name, datagram, whether the filter must keep it) in the given byte order."""

    def m(what, *fields, **header):
        return _message(what, *fields, byteorder=byteorder, **header)

    order = "<" if byteorder == "little" else ">"
    nlmsgerr = struct.pack(f"{order}i", -105) + m(_NONE)[:16]  # error + the request's header
    error = struct.pack(f"{order}IHHII", 16 + len(nlmsgerr), 2, 0, 0, 0) + nlmsgerr
    return [
        ("exec", m(PROC_EVENT_EXEC, 100, 100), True),
        ("exec by a thread", m(PROC_EVENT_EXEC, 101, 100), True),
        ("leader exit", m(PROC_EVENT_EXIT, 300, 300, 0, 17), True),
        ("thread exit", m(PROC_EVENT_EXIT, 201, 200, 0, 0), False),
        ("fork", m(_FORK, 1, 1, 400, 400), False),
        ("comm", m(_COMM, 400, 400, *b"worker\0\0\0\0\0\0\0\0\0\0"), False),
        ("uid", m(_UID, 400, 400, 0, 0), False),
        ("gid", m(_GID, 400, 400, 0, 0), False),
        ("sid", m(_SID, 400, 400), False),
        ("ptrace", m(_PTRACE, 400, 400, 1, 1, 0x10), False),
        ("coredump", m(_COREDUMP, 400, 400, 1, 1), False),
        ("ack", m(_NONE, 0, 0), False),
        ("empty", b"", True),
        ("short", m(PROC_EVENT_EXIT, 201, 200)[:59], True),
        ("noop", struct.pack(f"{order}IHHII", 16, 1, 0, 0, 0), True),
        ("netlink error", error, True),
        ("other connector idx", m(_FORK, 1, 1, idx=2), True),
        ("other connector val", m(_FORK, 1, 1, val=2), True),
        ("not NLMSG_DONE", m(_FORK, 1, 1, nl_type=0x10), True),
        ("fork then leader exit", m(_FORK, 1, 1, 9, 9) + m(PROC_EVENT_EXIT, 9, 9), True),
        ("fork then trailing bytes", m(_FORK, 1, 1, 9, 9) + b"\0" * 8, True),
    ]


_BYTE_ORDERS = ["little", "big"]


@pytest.mark.parametrize("byteorder", _BYTE_ORDERS)
def test_the_filter_keeps_exec_and_leader_exit_and_drops_the_rest(byteorder):
    """Run through a classic-BPF interpreter, the filter keeps whole every exec, every exit
    of a thread-group leader, and anything it cannot judge as one proc event (short, not
    NLMSG_DONE, another connector channel, more than one message: the parser judges those);
    it drops a thread's exit and fork, comm, uid, gid, sid, ptrace, coredump and acks. Both
    byte orders: a constant compared unswapped with the big-endian load fails here."""
    program = proc_event_filter(byteorder)
    for name, datagram, kept in _filter_cases(byteorder):
        verdict = run_classic_bpf(program, datagram)
        if kept:
            assert verdict >= len(datagram), f"{name}: kept {verdict} of {len(datagram)} bytes"
        else:
            assert verdict == 0, f"{name}: kept, should be dropped"


def test_the_filter_never_drops_what_the_parser_reports():
    """Fail-closed in one line: every datagram from which parse_datagram takes an exec or
    an exit passes the filter (in the host's order, where the parser runs)."""
    program = proc_event_filter()
    for name, datagram, _ in _filter_cases(sys.byteorder):
        if parse_datagram(datagram) != (set(), set()):
            assert run_classic_bpf(program, datagram) >= len(datagram), name


def _drain(source: ProcEvents) -> Events:
    """Everything the source has now (reads until a read finds nothing)."""
    seen = Events()
    while True:
        before = source.datagrams_read
        news = source.read(0)
        seen.execs |= news.execs
        seen.exits |= news.exits
        seen.lost |= news.lost
        if source.datagrams_read == before:
            return seen


def test_the_kernel_drops_thread_events_before_they_are_read(events):
    """With a real connector, 100 threads started and joined (200 events: a fork and a
    thread exit each) reach an unfiltered reader but not the filtered one. Both see the
    same noise from the rest of the machine (the filtered one a part of it), so the
    difference between their counts is at least the thread events, however busy the machine
    (no bound on the filtered count alone: a test run beside this one execs by the hundred)."""
    unfiltered = ProcEvents(filter_program=None)
    try:
        assert events.filtered and not unfiltered.filtered
        _drain(events)
        _drain(unfiltered)
        base_filtered, base_unfiltered = events.datagrams_read, unfiltered.datagrams_read
        threads = [threading.Thread(target=lambda: None) for _ in range(100)]
        for thread in threads:
            thread.start()
            thread.join()
        time.sleep(0.5)  # a joined thread's kernel exit may lag its Python end
        assert not _drain(events).lost
        assert not _drain(unfiltered).lost  # drained last: any later noise adds here
        filtered_read = events.datagrams_read - base_filtered
        unfiltered_read = unfiltered.datagrams_read - base_unfiltered
        assert unfiltered_read - filtered_read >= 200, (filtered_read, unfiltered_read)
    finally:
        unfiltered.close()


def test_a_filter_the_kernel_refuses_leaves_the_reader_unfiltered_and_working(caplog):
    """A program the kernel refuses (it does not end in a return) costs one warning and
    the optimisation, never the events: the reader still reports a process's exec and
    exit. (Stands for an old kernel or a seccomp policy refusing SO_ATTACH_FILTER.)"""
    with caplog.at_level(logging.WARNING):
        try:
            source = ProcEvents(filter_program=[(_LD_W_LEN, 0, 0, 0)])
        except ProcEventsUnavailable as e:
            pytest.skip(str(e))
    try:
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert not source.filtered and len(warnings) == 1, caplog.text
        assert "filter" in warnings[0].getMessage()
        child = subprocess.Popen(["/bin/true"])
        child.wait()
        assert exec_and_exit_seen(source, child.pid)
    finally:
        source.close()
