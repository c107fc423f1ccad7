"""Waiting for a child process's exit at the moment it exits, for timings.

``subprocess``'s waits with a timeout poll: ``Popen.wait(timeout)`` (and so
``subprocess.run(..., timeout=...)`` without pipes) checks the child, sleeps
1, 2, 4, 8, 16, 32, then 50 ms between checks. A child that exits after
20 ms is seen at 31 ms, one that exits after 33 ms at 63 ms: every duration
timed that way lands on one of those steps. This module waits on a pidfd
(Linux 5.3+), which becomes readable when the child exits, so the time taken
is the child's own. The benchmarks time runc and the daemon with it.
"""

from __future__ import annotations

import os
import select
import subprocess
import threading
from collections.abc import Sequence


def wait_for_exit(process: subprocess.Popen, timeout: float) -> int:
    """The exit status of ``process``, returned as soon as it exits (no polling).

    Raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds, the process left
    running, as ``Popen.wait`` does.
    """
    if process.returncode is not None:
        return process.returncode
    try:
        pidfd = os.pidfd_open(process.pid)
    except ProcessLookupError:  # already reaped elsewhere; Popen knows how to say so
        return process.wait()
    try:
        readable, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    if not readable:
        raise subprocess.TimeoutExpired(process.args, timeout)
    return process.wait()  # the child has exited: this reaps it without sleeping


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    input: bytes | str | None = None,
    check: bool = False,
    **popen_kwargs,
) -> subprocess.CompletedProcess:
    """``subprocess.run`` that returns when the child exits, not at the next poll.

    ``input``, ``capture_output=True`` and ``check`` work as in ``subprocess.run``; past
    ``timeout`` seconds the child is killed and ``subprocess.TimeoutExpired`` raised.
    """
    if popen_kwargs.pop("capture_output", False):
        popen_kwargs["stdout"] = popen_kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        popen_kwargs["stdin"] = subprocess.PIPE
    timed_out = threading.Event()
    with subprocess.Popen(argv, **popen_kwargs) as process:

        def kill() -> None:
            timed_out.set()
            process.kill()

        # A timer thread, not communicate(timeout): communicate's own wait polls.
        killer = threading.Timer(timeout, kill)
        killer.daemon = True
        killer.start()
        try:
            stdout, stderr = process.communicate(input)  # no timeout: a blocking waitpid
        finally:
            killer.cancel()
        if timed_out.is_set():
            raise subprocess.TimeoutExpired(process.args, timeout, stdout, stderr)
        done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done
