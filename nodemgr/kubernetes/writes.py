"""The Kubernetes adapter's write bookkeeping: coalescing queue, backoff, event rate limit.

Pure (no I/O, threads or lock: the adapter serialises access; the caller's clock).

- ``WriteQueue``: one pending write per key; a newer value is merged into the pending
  one, so a burst, or what piled up while the API server was down, goes out as one
  request. A failed write comes back with exponential backoff; the API server answering
  again makes everything due at once.
- ``EventLimiter``: the same (namespace, pod, reason) at most once per interval, at
  most ``rate_per_second`` overall; what it suppresses is folded into the next event.

What it must not do: talk to the API server, sleep, or know the kubernetes client.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Merge = Callable[[Any, Any], Any]  # (older pending value, newer value) -> value to send
K = TypeVar("K", bound=Hashable)  # a WriteQueue's keys


def replace(_older: Any, newer: Any) -> Any:
    """For a complete desired state (node labels)."""
    return newer


def merge_keys(older: dict[Any, Any], newer: dict[Any, Any]) -> dict[Any, Any]:
    """For partial patches (annotations)."""
    return {**older, **newer}


@dataclass
class Backoff:
    initial_seconds: float = 0.5
    max_seconds: float = 30.0
    failures: int = 0

    def next_delay_seconds(self) -> float:
        delay: float = min(self.initial_seconds * (2 ** min(self.failures, 30)), self.max_seconds)
        self.failures += 1
        return delay

    def reset(self) -> None:
        self.failures = 0


@dataclass
class _Pending:
    value: Any
    merge: Merge
    due_at: float
    backoff: Backoff
    last_error: str | None = None
    order: int = 0  # among writes due at once, the first queued goes first


@dataclass
class WriteQueue(Generic[K]):
    """At most one write in flight per key. Due times are in a heap: after a full
    republish hundreds of writes are pending, and a scan per take would drain them in
    quadratic time."""

    clock: Callable[[], float]
    initial_backoff_seconds: float = 0.5
    max_backoff_seconds: float = 30.0
    _pending: dict[K, _Pending] = field(default_factory=dict)
    # With their backoff, so a failure continues the sequence.
    _in_flight: dict[K, Backoff] = field(default_factory=dict)
    # (due_at, order, key); an entry whose write was rescheduled since is skipped.
    _due: list[tuple[float, int, K]] = field(default_factory=list)
    _orders: itertools.count[int] = field(default_factory=itertools.count)

    def put(self, key: K, value: Any, merge: Merge = replace) -> None:
        """A pending write for ``key`` keeps its due time."""
        pending = self._pending.get(key)
        if pending is not None:
            pending.value = merge(pending.value, value)
            pending.merge = merge
            return
        backoff = self._in_flight.get(key) or self._new_backoff()
        # A key in flight is not due before its write ends (take() skips in-flight keys).
        self._add(key, _Pending(value, merge, self.clock(), backoff))

    def take(self) -> tuple[K, Any] | None:
        key = self._first_due(self.clock())
        if key is None:
            return None
        pending = self._pending.pop(key)
        self._in_flight[key] = pending.backoff
        return key, pending.value

    def done(self, key: K) -> None:
        backoff = self._in_flight.pop(key, None)
        if backoff is not None:
            backoff.reset()  # shared with a value queued meanwhile, which starts afresh

    def retry(self, key: K, value: Any, merge: Merge, error: str) -> float:
        """A newer value queued meanwhile is merged over the failed one; the delay."""
        backoff = self._in_flight.pop(key, None) or self._new_backoff()
        delay = backoff.next_delay_seconds()
        pending = self._pending.get(key)
        if pending is not None:
            pending.value = merge(value, pending.value)
            pending.due_at = self.clock() + delay
            pending.backoff = backoff
            pending.last_error = error
            heapq.heappush(self._due, (pending.due_at, pending.order, key))
        else:
            self._add(key, _Pending(value, merge, self.clock() + delay, backoff, error))
        return delay

    def reset_backoff(self) -> None:
        now = self.clock()
        for pending in self._pending.values():
            pending.due_at = min(pending.due_at, now)
            pending.backoff.reset()
        for backoff in self._in_flight.values():
            backoff.reset()
        self._due = [(p.due_at, p.order, k) for k, p in self._pending.items()]
        heapq.heapify(self._due)

    def seconds_until_due(self) -> float | None:
        key = self._first_due(float("inf"))
        if key is None:
            return None
        return max(0.0, self._pending[key].due_at - self.clock())

    def _add(self, key: K, pending: _Pending) -> None:
        pending.order = next(self._orders)
        self._pending[key] = pending
        heapq.heappush(self._due, (pending.due_at, pending.order, key))

    def _first_due(self, now: float) -> K | None:
        due, skipped, found = self._due, [], None
        while due and due[0][0] <= now:
            due_at, order, key = due[0]
            pending = self._pending.get(key)
            if pending is None or pending.order != order or pending.due_at != due_at:
                heapq.heappop(due)  # stale: taken, requeued or rescheduled since
            elif key in self._in_flight:
                skipped.append(heapq.heappop(due))  # due once its write ends
            else:
                found = key
                break
        for entry in skipped:
            heapq.heappush(due, entry)
        return found

    def pending_value(self, key: K) -> Any:
        pending = self._pending.get(key)
        return None if pending is None else pending.value

    def clear(self) -> None:
        self._pending.clear()
        self._due.clear()

    def __len__(self) -> int:
        return len(self._pending.keys() | self._in_flight.keys())

    def _new_backoff(self) -> Backoff:
        return Backoff(self.initial_backoff_seconds, self.max_backoff_seconds)


FORGET_INTERVALS = 10


@dataclass
class _KeyState:
    seen_at: float
    last_emitted_at: float | None = None
    suppressed: int = 0


@dataclass
class EventLimiter:
    clock: Callable[[], float]
    per_key_interval_seconds: float = 60.0
    rate_per_second: float = 5.0
    burst: float = 5.0
    _keys: dict[Hashable, _KeyState] = field(default_factory=dict)
    _tokens: float | None = None
    _refilled_at: float = 0.0
    _pruned_at: float = 0.0

    def admit(self, key: Hashable) -> int | None:
        """None: suppress this occurrence (it is counted); else the count to report (>= 1)."""
        now = self.clock()
        self._prune(now)
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _KeyState(now)
        state.seen_at = now
        if (
            state.last_emitted_at is not None
            and now - state.last_emitted_at < self.per_key_interval_seconds
        ):
            state.suppressed += 1
            return None
        if not self._take_token(now):
            state.suppressed += 1  # the next admitted occurrence of this key reports it
            return None
        count = 1 + state.suppressed
        state.last_emitted_at = now
        state.suppressed = 0
        return count

    def suppressed(self, key: Hashable) -> int:
        state = self._keys.get(key)
        return 0 if state is None else state.suppressed

    def _take_token(self, now: float) -> bool:
        if self._tokens is None:
            self._tokens, self._refilled_at = self.burst, now
        elapsed = max(0.0, now - self._refilled_at)
        self._tokens = min(self.burst, self._tokens + elapsed * self.rate_per_second)
        self._refilled_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def _prune(self, now: float) -> None:
        """A key silent for ``FORGET_INTERVALS`` intervals is forgotten, with its
        suppressed count."""
        interval = self.per_key_interval_seconds
        if now - self._pruned_at < interval:
            return
        self._pruned_at = now
        stale = [
            key
            for key, state in self._keys.items()
            if now - state.seen_at >= FORGET_INTERVALS * interval
            or (state.suppressed == 0 and now - state.seen_at >= interval)
        ]
        for key in stale:
            del self._keys[key]
