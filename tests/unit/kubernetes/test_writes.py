"""Pins nodemgr.kubernetes.writes (pure, driven by a hand-moved clock): the write queue
coalesces per key (a newer desired state replaces, a partial patch merges key by key),
keeps one write per key in flight, backs a failed write off exponentially to a cap and
makes everything due at once when the API server answers again; the event limiter lets
one event per (pod, reason) per interval and a bounded rate overall, folds what it
suppressed into the next event's count, and forgets keys that went quiet."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodemgr.kubernetes.writes import Backoff, EventLimiter, WriteQueue, merge_keys, replace
from tests.unit.kubernetes.support import FakeClock

# --- merges and backoff -------------------------------------------------------------------


def test_replace_and_merge_keys():
    """replace: the newer value wins whole; merge_keys: per key, the newer one wins."""
    assert replace({"a": "1"}, {"b": "2"}) == {"b": "2"}
    assert merge_keys({"a": "1", "b": "1"}, {"b": "2", "c": None}) == {
        "a": "1",
        "b": "2",
        "c": None,
    }


def test_backoff_doubles_to_its_cap_and_resets():
    """Delays double from the initial one up to the cap; reset starts over."""
    backoff = Backoff(initial_seconds=0.5, max_seconds=3.0)
    assert [backoff.next_delay_seconds() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.next_delay_seconds() == 0.5


def test_backoff_survives_a_very_long_outage():
    """Thousands of failures (days down) still give the cap, never an overflow."""
    backoff = Backoff(initial_seconds=0.5, max_seconds=30.0, failures=5000)
    assert backoff.next_delay_seconds() == 30.0


# --- write queue --------------------------------------------------------------------------


def test_queue_coalesces_per_key():
    """Two puts of one key are one write: merged patches, or the newer full state."""
    clock = FakeClock()
    queue = WriteQueue(clock)
    queue.put(("pod", "a"), {"x": "1", "y": "1"}, merge_keys)
    queue.put(("pod", "a"), {"y": "2", "z": None}, merge_keys)
    queue.put(("labels",), {"old": "1"}, replace)
    queue.put(("labels",), {"new": "1"}, replace)
    assert len(queue) == 2
    taken = dict([queue.take(), queue.take()])
    assert taken == {("pod", "a"): {"x": "1", "y": "2", "z": None}, ("labels",): {"new": "1"}}
    assert queue.take() is None


def test_queue_backoff_doubles_to_cap_and_resets():
    """A write failing again and again waits 0.5, 1, 2, 4, 4... s; the server answering
    again makes it due at once and its next failure starts from the initial delay."""
    clock = FakeClock()
    queue = WriteQueue(clock, initial_backoff_seconds=0.5, max_backoff_seconds=4.0)
    queue.put("k", 1)
    delays = []
    for _ in range(6):
        key, value = queue.take()
        delays.append(queue.retry(key, value, replace, "down"))
        assert queue.take() is None  # not due yet
        assert queue.seconds_until_due() == pytest.approx(delays[-1])
        clock.now += delays[-1]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    key, value = queue.take()
    queue.retry(key, value, replace, "down")
    queue.reset_backoff()  # the server is back
    assert queue.take() == ("k", 1)
    assert queue.retry("k", 1, replace, "down") == 0.5


def test_queue_value_queued_while_in_flight():
    """One write per key at a time: a value queued while one is in flight waits for it;
    after a failure it is merged over the failed one, after a success it goes next."""
    clock = FakeClock()
    queue = WriteQueue(clock)
    queue.put("pod", {"a": "1"}, merge_keys)
    key, value = queue.take()
    queue.put("pod", {"b": "2"}, merge_keys)
    assert queue.take() is None  # one write per key at a time
    assert len(queue) == 1
    # The write fails: the newer value is merged over the failed one and waits out the backoff.
    queue.retry(key, value, merge_keys, "down")
    assert queue.pending_value("pod") == {"a": "1", "b": "2"}
    assert queue.take() is None
    clock.now += 0.5
    key, value = queue.take()
    queue.put("pod", {"a": "3"}, merge_keys)
    queue.done(key)  # success: the newer value goes next, at once
    assert queue.take() == ("pod", {"a": "3"})
    queue.done("pod")
    assert len(queue) == 0


def test_queue_takes_the_earliest_due_first():
    """Of several due writes, the one due longest goes first (a failed write that waited
    out its backoff does not starve behind newer ones, nor jump them)."""
    clock = FakeClock()
    queue = WriteQueue(clock)
    queue.put("first", 1)
    key, value = queue.take()
    queue.retry(key, value, replace, "down")  # due again at 1000.5
    clock.now += 0.2
    queue.put("second", 2)  # due at 1000.2
    clock.now += 1.0
    assert [queue.take()[0], queue.take()[0]] == ["second", "first"]


def test_queue_empty_and_clear():
    """Nothing queued: nothing due, no wait; clear drops what is pending."""
    queue = WriteQueue(FakeClock())
    assert queue.take() is None and queue.seconds_until_due() is None and len(queue) == 0
    queue.put("k", 1)
    assert queue.seconds_until_due() == 0.0
    queue.clear()
    assert queue.take() is None and len(queue) == 0


def test_queue_drains_a_republish_in_order_without_rescanning():
    """A full republish queues hundreds of pods at once: they go out in the order they
    were queued, each take looking at the next one only (not every pending write)."""
    clock = FakeClock()
    queue = WriteQueue(clock)
    for i in range(500):
        queue.put(("pod", i), {"a": str(i)}, merge_keys)
    taken = []
    while (item := queue.take()) is not None:
        taken.append(item[0][1])
        queue.done(item[0])
    assert taken == list(range(500))
    assert len(queue._due) == 0  # nothing left behind in the heap either


class _ScanQueue:
    """The reference: the queue's rules written as plainly as possible (a scan per take)."""

    def __init__(self, clock):
        self.clock, self.pending, self.in_flight, self.failures = clock, {}, set(), {}

    def put(self, key, value):
        if key in self.pending:
            self.pending[key][0] = value
        else:
            self.pending[key] = [value, self.clock()]

    def take(self):
        due = [(t, i, k) for i, (k, (_, t)) in enumerate(self.pending.items())
               if t <= self.clock() and k not in self.in_flight]  # fmt: skip
        if not due:
            return None
        key = min(due)[2]
        self.in_flight.add(key)
        return key, self.pending.pop(key)[0]

    def done(self, key):
        self.in_flight.discard(key)
        self.failures.pop(key, None)

    def retry(self, key, value):
        self.in_flight.discard(key)
        failures = self.failures.get(key, 0)
        self.failures[key] = failures + 1
        due = self.clock() + min(0.5 * 2**failures, 30.0)
        if key in self.pending:
            self.pending[key] = [self.pending[key][0], due]
        else:
            self.pending[key] = [value, due]

    def reset_backoff(self):
        for entry in self.pending.values():
            entry[1] = min(entry[1], self.clock())
        self.failures.clear()

    def seconds_until_due(self):
        times = [t for k, (_, t) in self.pending.items() if k not in self.in_flight]
        return None if not times else max(0.0, min(times) - self.clock())


_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 5), st.integers()),
        st.tuples(st.just("take"), st.just(0), st.just(0)),
        st.tuples(st.just("finish"), st.booleans(), st.just(0)),
        st.tuples(st.just("wait"), st.sampled_from([0.1, 0.5, 1.0, 7.0]), st.just(0)),
        st.tuples(st.just("reset"), st.just(0), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(_STEPS)
def test_queue_agrees_with_a_scan_over_every_pending_write(steps):
    """Random puts, takes, successes, failures, waits and API-back resets: the heap-kept
    queue takes the same write, gives the same wait and holds the same count as the plain
    scan it replaced."""
    clock = FakeClock()
    queue, model = WriteQueue(clock), _ScanQueue(clock)
    taken: list = []
    for op, a, b in steps:
        if op == "put":
            queue.put(a, b)
            model.put(a, b)
        elif op == "take":
            got = queue.take()
            assert got == model.take()
            if got is not None:
                taken.append(got)
        elif op == "finish" and taken:
            key, value = taken.pop(0)
            if a:
                queue.done(key)
                model.done(key)
            else:
                queue.retry(key, value, replace, "down")
                model.retry(key, value)
        elif op == "wait":
            clock.now += a
        elif op == "reset":
            queue.reset_backoff()
            model.reset_backoff()
        assert queue.seconds_until_due() == model.seconds_until_due()
        assert len(queue) == len(model.pending.keys() | model.in_flight)


# --- event rate limit ---------------------------------------------------------------------


def test_event_limiter_folds_suppressed_into_next():
    """The same pod and reason within the interval is suppressed and counted; the next
    event after the interval reports them all; another pod has its own window."""
    clock = FakeClock()
    limiter = EventLimiter(clock, per_key_interval_seconds=60.0)
    key = ("ml", "train-0", "GPUShareRefused")
    assert limiter.admit(key) == 1
    for _ in range(4):
        clock.now += 10
        assert limiter.admit(key) is None
    assert limiter.suppressed(key) == 4
    assert limiter.admit(("ml", "other", "GPUShareRefused")) == 1  # another pod: its own window
    clock.now += 21  # 61 s after the first
    assert limiter.admit(key) == 5  # this one and the 4 suppressed
    assert limiter.suppressed(key) == 0


def test_event_limiter_overall_rate():
    """Beyond the burst, events wait for tokens (rate per second); a suppressed one is
    folded into that key's next admitted event."""
    clock = FakeClock()
    limiter = EventLimiter(clock, rate_per_second=5.0, burst=5.0)
    admitted = [limiter.admit(("ns", f"pod-{i}", "R")) for i in range(8)]
    assert admitted == [1] * 5 + [None] * 3
    clock.now += 0.2  # one token back
    assert limiter.admit(("ns", "pod-5", "R")) == 2  # its suppressed occurrence folded in
    assert limiter.admit(("ns", "pod-6", "R")) is None


def test_event_limiter_forgets_old_keys():
    """Keys sent and quiet for an interval are forgotten; keys with suppressed occurrences
    wait for their next event, but not for ever (FORGET_INTERVALS)."""
    clock = FakeClock()
    limiter = EventLimiter(clock, per_key_interval_seconds=60.0, rate_per_second=5.0, burst=5.0)
    for i in range(10):
        limiter.admit(("ns", f"pod-{i}", "R"))  # 5 sent, 5 suppressed by the overall rate
    clock.now += 61
    limiter.admit(("ns", "new", "R"))
    # Sent keys are forgotten after their interval; suppressed counts wait for a next event...
    assert limiter.suppressed(("ns", "pod-9", "R")) == 1
    assert len(limiter._keys) == 6
    clock.now += 600
    limiter.admit(("ns", "new", "R"))
    assert len(limiter._keys) == 1  # ...but not for ever (pods come and go)
