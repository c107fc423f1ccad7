"""Pins standins/threadstats.py: a polling thread is seen waking up, a blocked one is not
(so the "never wakes up" tests of the servers can fail)."""

import threading
import time

from standins.threadstats import wakeups_while_idle


def test_a_polling_thread_is_seen_waking_and_a_blocked_one_is_not():
    """A thread in a 20 ms sleep loop wakes many times in 0.6 s; one waiting on an event, never."""
    done = threading.Event()

    def poll():
        while not done.is_set():
            time.sleep(0.02)

    polling = threading.Thread(target=poll, daemon=True)
    blocked = threading.Thread(target=done.wait, daemon=True)
    polling.start()
    blocked.start()
    try:
        assert wakeups_while_idle(polling) >= 10
        assert wakeups_while_idle(blocked) == 0
    finally:
        done.set()
