"""Fuzzes what nodemgr.enforcement.procfs reads from /proc with hostile bytes: a process picks
its cgroup names, its environ and (in part) its stat line, and can vanish at any moment. Bytes
that are not UTF-8, files over their cap, and reads that stop mid-file (the process exited:
ProcessLookupError, FileNotFoundError) or fail otherwise (EIO, EACCES) never raise anything but
procfs.ProcfsError (or read as None: gone), and what is returned has the documented types.

Each property is bounded to a few hundred examples and no shrinking database, so the module
runs in a few seconds."""

from __future__ import annotations

import errno

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hooks.gpuenv import GPU_ENV_NAMES, EnvError, parse_pinned_limit, parse_thread_percentage
from nodemgr.domain.containercheck import CgroupError, parse_cgroups
from nodemgr.enforcement import procfs

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Bytes that look like /proc files: real separators and names mixed with hostile bytes.
PIECES = st.sampled_from(
    [b"0::/", b"4:memory:/kubepods/", b"\n", b":", b"/", b"\xff", b"\xc3", b"\xed\xa0\x80",
     b"\0", b"=", b"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=", b"NVIDIA_VISIBLE_DEVICES=",
     b"\xd9\xa3\xd9\xa0", b"\xc2\xa0", b"(", b")", b" ", b"S", b"Z", b"12345", b"-1", b"_"]
)  # fmt: skip
HOSTILE = st.one_of(
    st.binary(max_size=512),
    st.lists(st.one_of(PIECES, st.binary(max_size=8)), max_size=64).map(b"".join),
)


def stat_line(comm: bytes, fields: list[bytes]) -> bytes:
    return b"4242 (" + comm + b") " + b" ".join(fields) + b"\n"


STAT_FIELD = st.one_of(
    st.integers(0, 2**64).map(lambda n: str(n).encode()),
    st.sampled_from([b"-1", b"+3", b"1_0", b"\xd9\xa3", b"", b"R", b"Z", b"0x10", b"\xff"]),
)


@st.composite
def stat_lines(draw):
    """A real-looking stat line (52 fields) with a hostile command name and a few fields
    replaced by hostile ones, or cut short."""
    fields = [b"S"] + [str(draw(st.integers(0, 2**32))).encode() for _ in range(49)]
    for _ in range(draw(st.integers(0, 3))):
        fields[draw(st.integers(0, 49))] = draw(STAT_FIELD)
    fields = fields[: draw(st.sampled_from([50, 50, 50, 19, 20, 0]))]
    return stat_line(draw(st.binary(max_size=64)), fields)


STAT = st.one_of(
    HOSTILE,
    stat_lines(),
    st.builds(stat_line, st.binary(max_size=64), st.lists(STAT_FIELD, max_size=60)),
)


# --- the pure parsers ---------------------------------------------------------------------


@FUZZ
@given(HOSTILE)
def test_decode_cgroups_returns_text_or_raises_procfs_error(data):
    try:
        text = procfs.decode_cgroups(data)
    except procfs.ProcfsError as e:
        problem = str(e)
    else:
        problem = None
    if problem is not None:
        assert "UTF-8" in problem
        return
    assert isinstance(text, str) and text.encode() == data
    try:  # what the watchdog does with it next
        cgroups = parse_cgroups(text)
    except CgroupError:
        return
    assert all(isinstance(k, str) and v.startswith("/") for k, v in cgroups.items())


@FUZZ
@given(HOSTILE)
def test_parse_environ_never_raises_and_keeps_only_gpu_names(data):
    env = procfs.parse_environ(data)
    assert set(env) <= set(GPU_ENV_NAMES)
    for value in env.values():
        assert isinstance(value, str)
        value.encode("utf-8")  # valid text: no lone surrogates for the ledger or the log
        try:  # the quota parsers take it or refuse it with their own error
            parse_thread_percentage(value)
        except EnvError:
            pass
        try:
            parse_pinned_limit(value)
        except EnvError:
            pass


@FUZZ
@given(STAT)
def test_parse_stat_returns_ascii_numbers_or_raises_procfs_error(data):
    try:
        stat = procfs.parse_stat(data)
    except procfs.ProcfsError:
        return
    assert len(stat.state) == 1 and stat.state.isascii() and stat.state.isalpha()
    assert stat.parent >= 0 and stat.start_ticks >= 0


# --- the reads: huge files, and processes that vanish or fail mid-read ---------------------


class FakeFile:
    """/proc/PID/<file> as a hostile process makes it: ``data`` served in ``chunk``-sized
    reads, then ``error`` raised at read number ``fail_at`` (None: never)."""

    def __init__(self, data: bytes, chunk: int, fail_at: int | None, error: BaseException):
        self.data, self.chunk, self.fail_at, self.error = data, chunk, fail_at, error
        self.reads = 0
        self.offset = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read(self, size: int) -> bytes:
        self.reads += 1
        if self.fail_at is not None and self.reads >= self.fail_at:
            raise self.error
        n = min(size, self.chunk)
        piece = self.data[self.offset : self.offset + n]
        self.offset += len(piece)
        return piece


ERRORS = st.sampled_from(
    [
        ProcessLookupError(errno.ESRCH, "No such process"),
        FileNotFoundError(errno.ENOENT, "No such file or directory"),
        PermissionError(errno.EACCES, "Permission denied"),
        OSError(errno.EIO, "Input/output error"),
    ]
)
READS = {
    "cgroup": (procfs.read_cgroups_text, procfs.CGROUP_MAX_BYTES, (str,)),
    "environ": (procfs.read_gpu_env, procfs.ENVIRON_MAX_BYTES, (dict,)),
    "stat": (procfs.read_stat, procfs.STAT_MAX_BYTES, (procfs.Stat,)),
    "start": (procfs.read_start_ticks, procfs.STAT_MAX_BYTES, (int,)),
    "parent": (procfs.read_parent, procfs.STAT_MAX_BYTES, (int,)),
}


def blown_up(base: bytes, size: int | None) -> bytes:
    """``base`` repeated to exactly ``size`` bytes (None: ``base`` itself)."""
    if size is None:
        return base
    return ((base or b"x") * (size // max(len(base), 1) + 1))[:size]


@st.composite
def proc_files(draw):
    """(which read, base bytes, size to blow them up to or None, chunk, fail_at, error):
    small enough to print when hypothesis reports a failing case."""
    which = draw(st.sampled_from(sorted(READS)))
    _, cap, _ = READS[which]
    size = draw(st.sampled_from([None, cap, cap + 1, cap * 2 + 7]))
    base = draw(STAT if which in ("stat", "start", "parent") else HOSTILE)
    # Tiny reads only of small files: a MiB read a byte at a time is slow, not hostile.
    chunks = [1, 7, 4096, 65536] if size is None else [4096, 65536, 1 << 20]
    chunk = draw(st.sampled_from(chunks))
    fail_at = draw(st.none() | st.integers(1, 6))
    error = draw(ERRORS)
    return which, base, size, chunk, fail_at, error


@FUZZ
@given(proc_files())
def test_reads_return_their_type_none_or_raise_procfs_error(monkeypatch_module, case):
    which, base, size, chunk, fail_at, error = case
    read, cap, types = READS[which]
    data = blown_up(base, size)
    opened = []

    def fake_open(path, mode="r", buffering=-1):
        assert mode == "rb"
        opened.append(FakeFile(data, chunk, fail_at, error))
        return opened[-1]

    monkeypatch_module.setattr(procfs, "_open", fake_open)
    try:
        got = read(4242)
    except procfs.ProcfsError as e:
        got = e
    if isinstance(got, procfs.ProcfsError):
        assert "/proc/4242/" in str(got)
        return
    if got is None:
        return  # gone (or a zombie, for the start time)
    assert isinstance(got, types)
    assert all(f.offset <= cap + 1 for f in opened), "read past the cap"
    if len(data) > cap:
        pytest.fail(f"{which}: {len(data)} bytes over the cap of {cap} were accepted")


@pytest.fixture(scope="module")
def monkeypatch_module():
    """One monkeypatch for all examples (hypothesis runs a function-scoped fixture once)."""
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_a_vanishing_process_reads_as_gone_whatever_it_had_served():
    """ESRCH or ENOENT mid-read: gone (None), never a half-read value."""
    for error in (ProcessLookupError(errno.ESRCH, "x"), FileNotFoundError(errno.ENOENT, "x")):

        def vanishing(*args, error=error, **kwargs):
            return FakeFile(b"0::/a\n" * 9, 5, 3, error)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(procfs, "_open", vanishing)
            assert procfs.read_cgroups_text(1) is None
            assert procfs.read_gpu_env(1) is None
            assert procfs.read_start_ticks(1) is None
