"""Pins nodemgr.common.wakepipe.WakePipe: a wake ends another thread's select at once, a
drain forgets it, many wakes never block the waker, and a wake after close writes nothing
(the descriptor numbers may already belong to other files)."""

import os
import select
import threading
import time

from nodemgr.common.wakepipe import WakePipe


def test_a_wake_ends_a_select_in_another_thread_at_once():
    """A select with a 30 s timeout returns as soon as another thread wakes the pipe."""
    pipe = WakePipe()
    returned = []
    waiter = threading.Thread(
        target=lambda: returned.append(select.select([pipe.fileno()], [], [], 30)[0])
    )
    waiter.start()
    time.sleep(0.1)
    started = time.monotonic()
    pipe.wake()
    waiter.join(5)
    assert returned == [[pipe.fileno()]] and time.monotonic() - started < 5
    pipe.close()


def test_drain_forgets_the_wakes_and_many_wakes_never_block():
    """Wakes beyond the pipe's capacity are dropped, not waited on; after a drain the
    pipe is no longer readable."""
    pipe = WakePipe()
    for _ in range(100_000):
        pipe.wake()
    pipe.drain()
    while select.select([pipe.fileno()], [], [], 0)[0]:
        pipe.drain()
    assert select.select([pipe.fileno()], [], [], 0)[0] == []
    pipe.close()


def test_a_wake_after_close_writes_nothing_and_close_is_idempotent():
    """Once closed, wake() touches no descriptor: a file opened since, which may reuse the
    write end's number, stays empty."""
    pipe = WakePipe()
    pipe.close()
    r, w = os.pipe()
    try:
        pipe.wake()
        pipe.close()
        os.set_blocking(r, False)
        try:
            data = os.read(r, 10)
        except BlockingIOError:
            data = b""
        assert data == b""
    finally:
        os.close(r)
        os.close(w)
