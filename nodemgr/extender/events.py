"""Pod Events from the extender, posted by a thread of their own, never blocking the caller.

For pods the cache reports (``ClusterCache.on_ignored``). A pod owner can make many
such pods, so they are rate-limited as the node daemon's (``EventLimiter``); a full queue
drops the event (counted).

What it must not do: block the watch thread, or stop on an API error.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from nodemgr.errors import KubeApiError
from nodemgr.kubernetes.writes import EventLimiter

log = logging.getLogger("nodemgr.extender")

PLACEMENT_IGNORED_REASON = "GPUSharePlacementIgnored"
QUEUE_SIZE = 256

# (namespace, pod, pod UID, reason, message, count)
Post = Callable[[str, str, str, str, str, int], None]


class EventPoster:
    def __init__(
        self,
        post: Post,
        clock: Callable[[], float] = time.monotonic,
        events_per_second: float = 5.0,
    ):
        self._post = post
        self._limiter = EventLimiter(clock, rate_per_second=events_per_second)
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, str, str, str, str, int] | None] = queue.Queue(
            QUEUE_SIZE
        )
        self.dropped = 0
        self.posted = 0
        self.thread = threading.Thread(target=self._run, name="events", daemon=True)

    def record(self, namespace: str, pod: str, uid: str, reason: str, message: str) -> None:
        with self._lock:
            count = self._limiter.admit((namespace, pod, reason))
        if count is None:
            return
        try:
            self._queue.put_nowait((namespace, pod, uid, reason, message, count))
        except queue.Full:
            self.dropped += 1

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # a daemon thread: it ends with the process

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._post(*item)
                self.posted += 1
            except KubeApiError as e:
                log.info("event %s on pod %s/%s not posted: %s", item[3], item[0], item[1], e)
            except Exception:
                log.exception("event %s on pod %s/%s not posted", item[3], item[0], item[1])
