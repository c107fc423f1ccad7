"""The one asyncio event loop, in one thread, that serves every device plugin server.

Idle, nothing wakes until kubelet calls or a device change is announced (a synchronous
``grpc.server`` wakes its polling thread five times a second per server). The loop
lives as long as the process: gRPC's asyncio layer keeps per-process state tied to the
loop it first served on. If its thread ever ends (a bug), that is logged CRITICAL, its
servers stop being ``alive`` and the next start makes a new loop.

What it must not do: run anything that blocks for long; the calls it serves
are the allocator's, which are short.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class PluginLoop:
    def __init__(self, thread_name: str = "device-plugins") -> None:
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def thread(self) -> threading.Thread | None:
        """None before the first server."""
        return self._thread

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_seconds: float) -> T:
        """TimeoutError (the coroutine cancelled) past ``timeout_seconds``."""
        loop = self._running_loop()
        future = asyncio.run_coroutine_threadsafe(coroutine, loop)
        try:
            return future.result(timeout_seconds)
        except TimeoutError:
            future.cancel()
            raise

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is not None and self.running:
                return self._loop
            if self._loop is not None:
                log.critical("the device plugin event loop had stopped: starting a new one")
            loop = asyncio.new_event_loop()
            loop.set_exception_handler(_log_loop_error)
            started = threading.Event()
            thread = threading.Thread(
                target=self._serve, args=(loop, started), name=self._thread_name, daemon=True
            )
            thread.start()
            started.wait()
            self._loop, self._thread = loop, thread
            return loop

    def _serve(self, loop: asyncio.AbstractEventLoop, started: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(started.set)
        try:
            loop.run_forever()
        except BaseException:
            log.critical("the device plugin event loop failed", exc_info=True)
            raise
        finally:
            # Nothing stops it on purpose: ending here is a bug, never silent.
            log.critical("the device plugin event loop ended; its servers no longer answer")


def _log_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """What asyncio would print to stderr goes to the log."""
    error = context.get("exception")
    log.error(
        "device plugin event loop: %s",
        context.get("message", "unexpected error"),
        exc_info=(type(error), error, error.__traceback__) if error is not None else None,
    )


PLUGIN_LOOP = PluginLoop()
