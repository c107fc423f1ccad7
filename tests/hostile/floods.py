"""Clients that try to exhaust a listener of the daemon, and what the daemon held meanwhile.

A flood is one kind of hostile client, many times over: connections that never send
anything (``Flood``), a byte now and then (``trickle``), a request far over any budget
(``oversized``), bytes that are no request at all (``garbage``). The daemon's side is read
from /proc: how many files it holds open (``FdWatch``), against its RLIMIT_NOFILE.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

Connect = Callable[[], socket.socket]


def tcp(host: str, port: int, first: bytes = b"") -> Connect:
    """A connection to ``host:port`` once the daemon's kernel queued it for accept, that
    sends ``first`` at once. One byte makes the kernel deliver a connection whose last
    handshake packet a full listen queue dropped (an idle one would stay open on this side
    only), or answer with a reset that the flood sees."""

    def connect() -> socket.socket:
        sock = socket.create_connection((host, port), timeout=CONNECT_SECONDS)
        try:
            sock.sendall(first)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        return sock

    return connect


def unix(path: str) -> Connect:
    """A connection to the unix socket ``path``, tried again while its listen queue is full
    (a unix connect says EAGAIN then, it does not wait), for at most ``CONNECT_SECONDS``."""

    def connect() -> socket.socket:
        deadline = time.monotonic() + CONNECT_SECONDS
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            while True:
                try:
                    sock.connect(path)
                    return sock
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.005)
        except OSError:
            sock.close()
            raise

    return connect


# A connect waits this long (the kernel retries a SYN its listen queue dropped); this many
# failing in a row, the listener takes no more.
CONNECT_SECONDS = 10.0
DIALERS = 16  # connects under way at once


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed or reset the connection (what it sent is read away: a
    gRPC server sends its HTTP/2 settings first, an HTTP server its answer)."""
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return False
    except OSError as e:
        return e.errno != errno.EAGAIN
    return True


class Flood:
    """``count`` connections that send nothing, ``DIALERS`` connects at a time, each waiting
    until the daemon's kernel queued it (a burst all at once would overflow the listen queue
    and be dropped by the kernel, never reaching the daemon), until all are open or the
    listener takes no more (``DIALERS`` connects in a row failed: ``saturated``). With
    ``reopen`` each connection the daemon closes is opened again (the attacker keeps the
    pressure on). A context manager: every connection is closed on leaving it."""

    def __init__(self, connect: Connect, count: int, reopen: bool = False):
        self._connect = connect
        self.count = count
        self.reopen = reopen
        self.opened = 0  # connections made, reopened ones included
        self.closed_by_daemon = 0
        self.failed = 0  # connects that failed (the listener took no more, or refused)
        self.saturated = False
        self._lock = threading.Lock()
        self._socks: list[socket.socket | None] = [None] * count
        self._todo = list(range(count))  # slots to (re)open, the first round first
        self._tried = 0  # slots of the first round tried
        self._in_a_row = 0  # failures in a row
        self._stop = threading.Event()
        self._first_round = threading.Event()
        self._threads = [
            threading.Thread(target=self._dial, name=f"flood-{i}", daemon=True)
            for i in range(DIALERS)
        ]
        self._threads.append(threading.Thread(target=self._watch, name="flood", daemon=True))

    def __enter__(self) -> Flood:
        for thread in self._threads:
            thread.start()
        if not self._first_round.wait(600):
            raise AssertionError(f"{self.count} connections not tried within 600 s")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(CONNECT_SECONDS + 5)
        for sock in self._socks:
            if sock is not None:
                sock.close()

    @property
    def held(self) -> int:
        """Connections open on this side (the daemon may have closed some since)."""
        return sum(sock is not None for sock in self._socks)

    def _dial(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                slot = self._todo.pop(0) if self._todo and not self.saturated else None
            if slot is None:
                self._stop.wait(0.05)
                continue
            try:
                sock: socket.socket | None = self._connect()
            except OSError:
                sock = None
            with self._lock:
                self._socks[slot] = sock
                if sock is None:
                    self.failed += 1
                    self._in_a_row += 1
                    self.saturated = self.saturated or self._in_a_row >= DIALERS
                else:
                    self.opened += 1
                    self._in_a_row = 0
                if self._tried < self.count:
                    self._tried += 1
                if self._tried == self.count or self.saturated:
                    self._first_round.set()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            if not self._first_round.is_set():
                continue
            with self._lock:
                pending = set(self._todo)
                for slot, sock in enumerate(self._socks):
                    if sock is None or not closed_by_peer(sock):
                        continue
                    self.closed_by_daemon += 1
                    sock.close()
                    self._socks[slot] = None
                    if self.reopen and slot not in pending:
                        self._todo.append(slot)


class FdWatch:
    """The daemon's open files, sampled every 50 ms while the context is open: ``peak``."""

    def __init__(self, pid: int):
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fd-watch", daemon=True)

    def open_files(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def __enter__(self) -> FdWatch:
        self.peak = self.open_files()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, self.open_files())
            except OSError:
                return  # the daemon is gone: the test says so


def nofile_limit(pid: int) -> int:
    """The soft RLIMIT_NOFILE of process ``pid`` (/proc/PID/limits)."""
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise AssertionError(f"/proc/{pid}/limits names no open files limit")


@dataclass
class Trickled:
    connections: int
    longest_held_seconds: float  # until the daemon closed one
    still_open: int  # after the watch


def trickle(connect: Connect, connections: int, data: bytes, every_seconds: float,
            watch_seconds: float) -> Trickled:  # fmt: skip
    """``connections`` clients each sending the next byte of ``data`` every ``every_seconds``;
    how long the daemon held them (watched for ``watch_seconds``)."""
    socks = [connect() for _ in range(connections)]
    started = time.monotonic()
    closed: dict[int, float] = {}
    sent = 0
    next_byte = started
    try:
        while len(closed) < connections and time.monotonic() - started < watch_seconds:
            if time.monotonic() >= next_byte and sent < len(data):
                for i, sock in enumerate(socks):
                    if i not in closed:
                        try:
                            sock.send(data[sent : sent + 1])
                        except OSError:
                            closed[i] = time.monotonic() - started
                sent += 1
                next_byte += every_seconds
            for i, sock in enumerate(socks):
                if i not in closed and closed_by_peer(sock):
                    closed[i] = time.monotonic() - started
            time.sleep(0.05)
    finally:
        for sock in socks:
            sock.close()
    return Trickled(connections, max(closed.values(), default=0.0), connections - len(closed))


def send_and_read(connect: Connect, data: bytes, seconds: float = 10.0) -> tuple[bytes, bool]:
    """Send ``data`` (as much as the daemon takes before it closes) and read its answer
    until it closes: (what it answered, whether it closed within ``seconds``)."""
    sock = connect()
    sock.setblocking(True)
    sock.settimeout(seconds)
    answer = b""
    try:
        view, sent = memoryview(data), 0
        while sent < len(data):
            try:
                sent += sock.send(view[sent : sent + 65536])
            except OSError:
                break  # the daemon closed it (or stopped reading for ``seconds``)
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return answer, False
            except OSError:
                return answer, True  # reset: closed with our bytes unread
            if not chunk:
                return answer, True
            answer += chunk
    finally:
        sock.close()
