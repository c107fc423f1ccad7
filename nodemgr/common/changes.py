"""A generation number that moves on every change, and threads that wait for it to move.

The allocation state, the pod watch and their followers (ListAndWatch streams, the
MPS supervisor, the publisher) share one shape: remember the generation acted on, wait
until it differs. ``wake_all`` lets waiters re-check without a change (a stop). A thread
that also waits on file descriptors registers a listener instead, called after every
bump and wake outside the lock; it must not block.

Lock order: an owner may bump while holding its own lock; waiters hold only this
object's condition, so no thread holds the condition and then asks for an owner's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


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
        with self._condition:
            self._generation += 1
            self._condition.notify_all()
            generation, listeners = self._generation, list(self._listeners)
        for listener in listeners:
            listener()
        return generation

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
