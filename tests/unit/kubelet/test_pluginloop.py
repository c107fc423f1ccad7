"""Pins nodemgr.kubelet.pluginloop: coroutines run on the one loop thread and give back
their result; one that overruns its time is cancelled and raises TimeoutError; a loop
whose thread ended (a bug) is logged CRITICAL, stops being ``running``, and the next run
makes a new loop."""

import asyncio
import logging
import time

import pytest

from nodemgr.kubelet.pluginloop import PluginLoop


@pytest.fixture
def loop():
    return PluginLoop("test-plugin-loop")


def test_coroutines_run_on_the_loop_thread_and_return(loop):
    """The coroutine runs in the loop's own thread; its result comes back."""

    async def where():
        return asyncio.get_running_loop(), __import__("threading").current_thread().name

    _, thread_name = loop.run(where(), 5)
    assert thread_name == "test-plugin-loop" and loop.running


def test_an_overrun_is_cancelled_and_raises(loop):
    """Past its time the caller gets TimeoutError and the coroutine is cancelled."""
    cancelled = []

    async def forever():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    with pytest.raises(TimeoutError):
        loop.run(forever(), 0.2)
    deadline = time.monotonic() + 5
    while not cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cancelled


def test_an_ended_loop_is_logged_and_replaced(loop, caplog):
    """A loop that stops (nothing stops it on purpose) says so at CRITICAL, is no longer
    running, and the next run starts a new loop that serves."""

    async def stop_the_loop():
        asyncio.get_running_loop().call_soon(asyncio.get_running_loop().stop)

    with caplog.at_level(logging.CRITICAL, logger="nodemgr.kubelet.pluginloop"):
        loop.run(stop_the_loop(), 5)
        loop.thread.join(5)
        assert not loop.running
        assert any("ended" in r.getMessage() for r in caplog.records)

        async def answer():
            return 42

        assert loop.run(answer(), 5) == 42
        assert loop.running
        assert any("starting a new one" in r.getMessage() for r in caplog.records)
