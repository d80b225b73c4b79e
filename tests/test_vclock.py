"""The virtual clock (``tests/vclock.py``): it jumps to the next timer when nothing can run,
never while a socket has something to read or a thread works for the loop, and it is put back
on real time when its loop closes."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import pytest
from aiohttp import web

from capyctl_gateway import _clock
from tests.vclock import VirtualLoop


def run(coro_fn: object) -> float:
    """Run ``coro_fn()`` on a new virtual loop; the real seconds it took."""
    began = time.monotonic()
    with asyncio.Runner(loop_factory=VirtualLoop) as runner:
        runner.run(coro_fn())  # type: ignore[operator]
    return time.monotonic() - began


def test_an_hour_of_sleep_passes_at_once_on_every_clock_the_gateway_reads() -> None:
    seen: dict[str, float] = {}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        t0, s0, w0 = loop.time(), _clock.stamp(), _clock.wall()
        await asyncio.sleep(3600)
        seen.update(loop=loop.time() - t0, stamp=_clock.stamp() - s0, wall=_clock.wall() - w0)

    took = run(main)
    assert took < 5
    assert all(3600 <= moved < 3601 for moved in seen.values()), seen
    assert _clock.offset() == 0  # back on real time once its loop closed
    assert abs(_clock.stamp() - time.monotonic()) < 0.01


def test_a_thread_working_for_the_loop_holds_the_clock() -> None:
    """A timer due in 10 s does not fire while an executor call runs for 0.3 s real."""
    order: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def timer() -> None:
            await asyncio.sleep(10)
            order.append("timer")

        task = loop.create_task(timer())
        await loop.run_in_executor(None, time.sleep, 0.3)
        order.append("thread")
        await task

    run(main)
    assert order == ["thread", "timer"]


def test_a_thread_the_loop_does_not_know_cannot_hold_it() -> None:
    """What it cannot drive, shown: a thread of its own answers after the timer has jumped."""
    order: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def work() -> None:
            time.sleep(0.3)
            loop.call_soon_threadsafe(done.set)

        threading.Thread(target=work).start()

        async def timer() -> None:
            await asyncio.sleep(10)
            order.append("timer")

        task = loop.create_task(timer())
        await done.wait()
        order.append("thread")
        await task

    run(main)
    assert order == ["timer", "thread"]


def test_loopback_io_is_answered_before_any_timeout_jumps() -> None:
    """A request over a real socket to a server in the loop, which answers after 5 s of its
    own time: the client's 30 s timeout never fires, and 5 s pass on the clock."""
    took: list[float] = []

    async def main() -> None:
        async def slow(request: web.Request) -> web.Response:
            await asyncio.sleep(5)
            return web.Response(text="late")

        app = web.Application()
        app.router.add_get("/", slow)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        try:
            timeout = aiohttp.ClientTimeout(total=30)
            async with aiohttp.ClientSession(timeout=timeout) as s:
                for _ in range(20):
                    began = _clock.stamp()
                    async with s.get(f"http://{host}:{port}/") as r:
                        assert await r.text() == "late"
                    took.append(_clock.stamp() - began)
        finally:
            await runner.cleanup()

    assert run(main) < 10
    assert all(5 <= t < 6 for t in took), took


def test_one_virtual_clock_at_a_time() -> None:
    async def main() -> None:
        with pytest.raises(RuntimeError, match="another virtual clock"):
            VirtualLoop()

    run(main)


def test_the_hot_paths_clock_moves_with_it_and_is_time_monotonic_unmoved() -> None:
    """`_clock.now` (the relay's, read at each call) is `stamp` while the clock is moved, and
    ``time.monotonic`` itself, no Python frame, before and after."""
    seen: dict[str, float] = {}
    assert _clock.now is time.monotonic

    async def main() -> None:
        s0, n0 = _clock.stamp(), _clock.now()
        await asyncio.sleep(3600)
        seen.update(stamp=_clock.stamp() - s0, now=_clock.now() - n0)
        seen["apart"] = abs(_clock.now() - _clock.stamp())

    run(main)
    assert 3600 <= seen["stamp"] < 3601 and 3600 <= seen["now"] < 3601, seen
    assert seen["apart"] < 0.01
    assert _clock.now is time.monotonic  # back on real time, without a frame
