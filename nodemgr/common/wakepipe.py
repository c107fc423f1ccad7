"""A pipe that ends another thread's ``select``: the wake-up of a blocking wait.

``wake`` after ``close`` does nothing: a closed descriptor's number may be reused by any
file, which a late wake must never write into.
"""

from __future__ import annotations

import contextlib
import os
import threading


class WakePipe:
    def __init__(self) -> None:
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self.closed = False

    def fileno(self) -> int:
        """The end to wait on (readable once woken, until ``drain``)."""
        return self._read

    def wake(self) -> None:
        with self._lock:
            if self.closed:
                return
            with contextlib.suppress(BlockingIOError):  # full: a wake is pending already
                os.write(self._write, b"x")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(self._read, 4096)

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                os.close(self._read)
                os.close(self._write)
