"""The relay's deadline: fires when due, moves later and earlier, and leaves other
cancellations alone. Times are loop times; waits are on events that never come."""

from __future__ import annotations

import asyncio

import pytest

from capyctl_gateway._relay.deadline import Deadline

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def never() -> None:
    await asyncio.Event().wait()


async def test_it_raises_timeout_error_at_its_time() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TimeoutError), Deadline(start + 0.05) as d:
        await never()
    assert d.expired
    assert loop.time() - start >= 0.05


async def test_moved_later_it_waits_for_the_new_time() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def push_back(d: Deadline) -> None:
        for _ in range(5):
            await asyncio.sleep(0.02)  # the engine's pace: a block every 20 ms
            # 25 times that pace: a loaded machine's late wake-up never lets it fire early
            d.move(loop.time() + 0.5)

    with pytest.raises(TimeoutError), Deadline(start + 0.5) as d:
        await push_back(d)
        pushed_to = d.when
        await never()
    assert loop.time() >= pushed_to > start + 0.1  # well past the first time


async def test_moved_earlier_it_fires_at_the_earlier_time() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TimeoutError), Deadline(start + 600) as d:
        d.move(start + 0.05)
        await never()
    assert loop.time() - start < 60


async def test_another_cancellation_stays_a_cancellation() -> None:
    loop = asyncio.get_running_loop()
    inside = asyncio.Event()

    async def body() -> None:
        with Deadline(loop.time() + 600):
            inside.set()
            await never()

    task = asyncio.ensure_future(body())
    await inside.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_nothing_fires_after_the_block_ends() -> None:
    loop = asyncio.get_running_loop()
    with Deadline(loop.time() + 0.02) as d:
        pass
    await asyncio.sleep(0.05)  # past the deadline: the task must not be cancelled
    assert not d.expired
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_first_check_before_the_deadline_does_not_end_it_early() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TimeoutError), Deadline(start + 0.1, first_check=start + 0.02) as d:
        await never()
    assert d.expired
    assert loop.time() - start >= 0.1


async def test_moved_past_the_first_check_it_waits_for_the_new_time() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TimeoutError), Deadline(start + 600, first_check=start + 0.05) as d:
        d.move(start + 0.1)  # later than the first check: no re-arm, the check re-arms itself
        await never()
    assert 0.1 <= loop.time() - start < 60


async def test_expiry_turned_into_another_error_leaves_the_task_uncancelled() -> None:
    loop = asyncio.get_running_loop()
    with pytest.raises(ValueError), Deadline(loop.time() + 0.01):
        try:
            await never()
        except asyncio.CancelledError:
            raise ValueError("handled its own way") from None
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_moving_it_after_the_block_arms_nothing() -> None:
    loop = asyncio.get_running_loop()
    with Deadline(loop.time() + 600) as d:
        pass
    d.move(loop.time())  # earlier than armed, but the block is over
    assert d._handle is None
