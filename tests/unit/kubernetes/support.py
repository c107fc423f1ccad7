"""What the Kubernetes adapter's tests share: names, a hand-moved clock, and waits on the
test API server (standins/apiserver_sim.py) that poll for a positive signal."""

from __future__ import annotations

import re
import time

MEM = "aliyun.com/gpu-mem"
CORE = "aliyun.com/gpu-core.percentage"
NODE = "node-a"
PREFIX = "gpushare.aliyun.com/"
TIMEOUT_SECONDS = 1.0  # kubernetes.request_timeout_seconds in these tests


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def wait_until(predicate, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def requests_of(api, method, path_regex, watch=None):
    rx = re.compile(path_regex)
    return [
        (m, p, q)
        for m, p, q in list(api.requests)
        if m == method
        and rx.search(p)
        and (watch is None or (q.get("watch") in ("true", "1")) == watch)
    ]


def names(cache):
    """The pods of an adapter's or a pod watch's cache, as namespace/name, sorted."""
    return sorted(f"{p.namespace}/{p.name}" for p in cache.pods())
