"""Pins nodemgr.common.changes.ChangeCounter: ``bump`` moves the generation and wakes
every waiter at once; a waiter whose generation is already stale returns without
waiting; a wait without a change ends at its timeout with the same generation; and
``wake_all`` lets waiters return without a change (how a stop interrupts a wait). Inside
``wakes_deferred`` a thread's bumps move the generation at once and wake waiters and
listeners once, when the block ends; other threads' bumps are not held."""

import threading
import time

from nodemgr.common.changes import ChangeCounter, wakes_deferred

LONG = 10.0  # a wait this long never ends by its timeout within a passing test


def waiter(counter: ChangeCounter, seen: int, timeout: float = LONG):
    """A thread blocked in wait_for_change; its result lands in the returned list."""
    result: list[int] = []
    thread = threading.Thread(
        target=lambda: result.append(counter.wait_for_change(seen, timeout)), daemon=True
    )
    thread.start()
    return thread, result


def test_bump_moves_the_generation_by_one():
    """Each bump returns the new generation, which ``generation`` then reads."""
    counter = ChangeCounter()
    assert counter.generation == 0
    assert [counter.bump() for _ in range(3)] == [1, 2, 3]
    assert counter.generation == 3


def test_a_stale_generation_returns_at_once():
    """A waiter that acted on an older generation does not wait at all."""
    counter = ChangeCounter()
    counter.bump()
    began = time.monotonic()
    assert counter.wait_for_change(0, LONG) == 1
    assert time.monotonic() - began < 1.0


def test_without_a_change_the_wait_ends_at_its_timeout():
    """No bump: the waiter gets its own generation back once the timeout passes."""
    counter = ChangeCounter()
    counter.bump()
    began = time.monotonic()
    assert counter.wait_for_change(1, 0.05) == 1
    assert time.monotonic() - began >= 0.05


def test_bump_wakes_every_waiter():
    """Several threads waiting on one generation all return with the new one after a bump."""
    counter = ChangeCounter()
    waiters = [waiter(counter, 0) for _ in range(4)]
    counter.bump()
    for thread, result in waiters:
        thread.join(5)
        assert not thread.is_alive(), "a waiter slept through the bump"
        assert result == [1]


def test_a_bump_from_another_thread_while_waiting():
    """A waiter in this thread wakes on a bump made by another thread."""
    counter = ChangeCounter()
    bumper = threading.Thread(target=counter.bump)
    began = time.monotonic()
    bumper.start()
    assert counter.wait_for_change(0, LONG) == 1
    assert time.monotonic() - began < LONG / 2
    bumper.join(5)


def test_wake_all_lets_waiters_return_without_a_change():
    """After wake_all (a stop was requested) a waiter returns, generation unchanged,
    long before its timeout: that is how PluginServer.stop and the publisher's stop
    interrupt their waits."""
    counter = ChangeCounter()
    thread, result = waiter(counter, 0, timeout=3.0)
    deadline = time.monotonic() + 1.0
    # wake_all is not sticky: repeat it until the waiter, once blocked, has seen one.
    while thread.is_alive() and time.monotonic() < deadline:
        counter.wake_all()
        thread.join(0.01)
    woke = not thread.is_alive()
    counter.bump()  # release it either way
    thread.join(5)
    assert woke, "wake_all did not end a wait_for_change"
    assert result == [0]


def test_listeners_hear_every_bump_and_wake_until_removed():
    """A listener (a thread that waits on descriptors, not on the condition) is called
    after each bump and each wake_all, and no more once removed."""
    changes = ChangeCounter()
    heard = []
    listener = lambda: heard.append(changes.generation)  # noqa: E731
    changes.add_listener(listener)
    changes.bump()
    changes.wake_all()
    changes.remove_listener(listener)
    changes.bump()
    assert heard == [1, 1]


def test_bumps_in_a_deferring_block_wake_once_at_its_end():
    """Two counters bumped (one twice) inside the block: the generations move at once, no
    waiter returns and no listener runs until the block ends; then each counter wakes its
    waiters and calls its listeners once."""
    first, second = ChangeCounter(), ChangeCounter()
    heard: list[str] = []
    first.add_listener(lambda: heard.append("first"))
    second.add_listener(lambda: heard.append("second"))
    thread, result = waiter(first, 0)
    with wakes_deferred():
        assert (first.bump(), first.bump(), second.bump()) == (1, 2, 1)
        assert first.generation == 2
        thread.join(0.2)
        assert thread.is_alive() and heard == []
    assert heard == ["first", "second"]
    thread.join(5)
    assert result == [2]


def test_a_deferring_block_that_raises_still_wakes():
    """The block ends with an error: what it bumped wakes all the same."""
    counter = ChangeCounter()
    heard: list[int] = []
    counter.add_listener(lambda: heard.append(counter.generation))
    try:
        with wakes_deferred():
            counter.bump()
            raise RuntimeError("the call failed")
    except RuntimeError:
        pass
    assert heard == [1]


def test_a_nested_block_wakes_at_the_outer_end_and_other_threads_are_not_held():
    """An inner block hands its bumps to the outer one; a bump by another thread while
    this one defers wakes at once."""
    counter = ChangeCounter()
    heard: list[str] = []
    counter.add_listener(lambda: heard.append(threading.current_thread().name))
    with wakes_deferred():
        with wakes_deferred():
            counter.bump()
        assert heard == []
        other = threading.Thread(target=counter.bump, name="other")
        other.start()
        other.join(5)
        assert heard == ["other"]
    assert heard == ["other", threading.current_thread().name]
