"""A generation number that moves on every change, and threads that wait for it to move.

The allocation state, the pod watch and their followers (ListAndWatch streams, the
MPS supervisor, the publisher) share one shape: remember the generation acted on, wait
until it differs. ``wake_all`` lets waiters re-check without a change (a stop). A thread
that also waits on file descriptors registers a listener instead, called after every
bump and wake outside the lock; it must not block.

Lock order: an owner may bump while holding its own lock; waiters hold only this
object's condition, so no thread holds the condition and then asks for an owner's lock.

``wakes_deferred``: a block in which the calling thread's bumps move the generation at
once but wake nobody until the block ends; then each counter it bumped wakes its waiters
and listeners once. For a worker whose call changes the state and still has work and an
answer to hand over (the DRA driver's thread): every thread a change wakes takes the GIL,
and on a busy node it took it from the rest of that call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

# Per thread: the counters bumped inside its wakes_deferred block, or None outside one.
_deferred = threading.local()


@contextlib.contextmanager
def wakes_deferred() -> Iterator[None]:
    """Hold the wake-ups of this thread's bumps until the block ends (module docstring).
    Nested blocks hand theirs to the outermost; a block that raises still wakes. Code
    inside must not wait for another thread to react to its own bumps."""
    if getattr(_deferred, "counters", None) is not None:
        yield
        return
    counters: list[ChangeCounter] = []
    _deferred.counters = counters
    try:
        yield
    finally:
        _deferred.counters = None
        failed: BaseException | None = None
        for counter in counters:  # every counter, even after a listener broke its contract
            try:
                counter._wake()
            except BaseException as e:
                failed = failed or e
        if failed is not None:
            raise failed


class ChangeCounter:
    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._generation = 0
        self._wakes = 0  # a waiter also returns when this moves
        self._listeners: list[Callable[[], None]] = []

    @property
    def generation(self) -> int:
        with self._condition:
            return self._generation

    def bump(self) -> int:
        """Something changed: the new generation; every waiter wakes (inside this
        thread's ``wakes_deferred`` block: when it ends)."""
        deferred = getattr(_deferred, "counters", None)
        with self._condition:
            self._generation += 1
            generation = self._generation
            if deferred is None:
                self._condition.notify_all()
                listeners = list(self._listeners)
        if deferred is not None:
            if not any(counter is self for counter in deferred):
                deferred.append(self)
            return generation
        for listener in listeners:
            listener()
        return generation

    def _wake(self) -> None:
        """Wake every waiter, then call every listener (outside the lock)."""
        with self._condition:
            self._condition.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def add_listener(self, listener: Callable[[], None]) -> None:
        with self._condition:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        with self._condition:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def wait_for_change(self, seen_generation: int, timeout: float) -> int:
        """The generation once it differs from ``seen_generation`` (or at ``timeout``)."""
        with self._condition:
            wakes = self._wakes
            self._condition.wait_for(
                lambda: self._generation != seen_generation or self._wakes != wakes, timeout
            )
            return self._generation

    def wake_all(self) -> None:
        with self._condition:
            self._wakes += 1
            self._condition.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener()
