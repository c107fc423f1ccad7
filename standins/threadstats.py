"""How often a thread of this process woke up: its voluntary context switches.

A thread blocked in ``select`` with no timeout does not switch at all while
nothing happens; one polling every 0.1 s switches ten times a second. Tests of
servers that must cost nothing at idle read this before and after a quiet spell.
"""

from __future__ import annotations

import threading
import time


def voluntary_switches(thread: threading.Thread) -> int:
    """The thread's voluntary context switches so far (Linux: /proc/self/task/TID/status)."""
    assert thread.native_id is not None, "the thread has not started"
    with open(f"/proc/self/task/{thread.native_id}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("this kernel does not show voluntary_ctxt_switches")


def wakeups_while_idle(thread: threading.Thread, seconds: float = 0.6) -> int:
    """How many times ``thread`` woke up during ``seconds`` in which nothing was asked of it."""
    time.sleep(0.05)  # let it reach its wait
    before = voluntary_switches(thread)
    time.sleep(seconds)
    return voluntary_switches(thread) - before
