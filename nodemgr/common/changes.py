"""A generation number that moves on every change, and threads that wait for it to move.

The allocation state, the pod watch and everything that follows them (the
ListAndWatch streams, the MPS supervisor, the publisher) share this one
shape: remember the generation you acted on, then wait until it differs.
``wake_all`` lets waiters re-check without a change (a worker being stopped).

Lock order: an owner may bump while holding its own lock; waiters hold only
this object's condition, so no thread ever holds the condition and then asks
for the owner's lock.
"""

from __future__ import annotations

import threading


class ChangeCounter:
    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._generation = 0
        self._wakes = 0  # counts wake_all calls: a waiter returns when it moves too

    @property
    def generation(self) -> int:
        with self._condition:
            return self._generation

    def bump(self) -> int:
        """Something changed: the new generation; every waiter wakes."""
        with self._condition:
            self._generation += 1
            self._condition.notify_all()
            return self._generation

    def wait_for_change(self, seen_generation: int, timeout: float) -> int:
        """Block until the generation differs from ``seen_generation`` (or timeout); the new one."""
        with self._condition:
            wakes = self._wakes
            self._condition.wait_for(
                lambda: self._generation != seen_generation or self._wakes != wakes, timeout
            )
            return self._generation

    def wake_all(self) -> None:
        """Let every waiter re-check at once, without a change (e.g. a stop was requested)."""
        with self._condition:
            self._wakes += 1
            self._condition.notify_all()
