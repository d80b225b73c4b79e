"""The hot path's loop accessor and request-ID randomness: same answers as asyncio and
``os.urandom`` would give, without their per-call system calls."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading

import pytest

from capyctl_gateway import _ulid
from capyctl_gateway._loop import running_loop


def test_running_loop_is_the_running_loop_across_loops_and_threads() -> None:
    async def probe() -> tuple[asyncio.AbstractEventLoop, asyncio.AbstractEventLoop]:
        return running_loop(), asyncio.get_running_loop()

    for _ in range(2):  # a second loop in the same thread: the first one's answer is stale
        got, expected = asyncio.run(probe())
        assert got is expected
    seen: list[bool] = []
    ready, go = threading.Event(), threading.Event()

    def other_thread() -> None:
        async def hold() -> None:
            seen.append(running_loop() is asyncio.get_running_loop())
            ready.set()
            await asyncio.to_thread(go.wait)
            seen.append(running_loop() is asyncio.get_running_loop())

        asyncio.run(hold())

    async def main_side() -> None:
        t = threading.Thread(target=other_thread)
        t.start()
        await asyncio.to_thread(ready.wait)
        seen.append(running_loop() is asyncio.get_running_loop())  # while the other runs
        go.set()
        await asyncio.to_thread(t.join)

    asyncio.run(main_side())
    assert seen == [True, True, True]


def test_running_loop_outside_a_loop_raises_as_asyncio_does() -> None:
    async def touch() -> None:
        running_loop()

    asyncio.run(touch())  # cached, then the loop stops
    with pytest.raises(RuntimeError):
        running_loop()


def _child_bits(out: multiprocessing.queues.SimpleQueue[int]) -> None:
    out.put(_ulid._random80())


def test_request_id_randomness_is_not_shared_with_a_forked_child() -> None:
    _ulid._random80()  # the parent holds a drawn pool
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.queues.SimpleQueue[int] = ctx.SimpleQueue()
    child = ctx.Process(target=_child_bits, args=(out,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert out.get() != _ulid._random80()


def test_request_ids_stay_unique_across_pool_refills() -> None:
    ids = {_ulid.new_ulid(7) for _ in range(3 * _ulid._DRAW // 10)}
    assert len(ids) == 3 * _ulid._DRAW // 10
