"""What each memory pool held over the last minutes (`PoolHistory`, the console's budget
view), on the virtual clock: a record at each change and none otherwise, the window's span and
the record count each reached."""

from __future__ import annotations

import anyio
import pytest

from capyctl_gateway._lifecycle.history import MAX_RECORDS, SPAN_S, PoolHistory
from tests.gateway.conftest import VIRTUAL_CLOCK

pytestmark = pytest.mark.anyio
anyio_backend = VIRTUAL_CLOCK
POOL = "this machine"


async def test_a_record_at_each_change_and_none_otherwise() -> None:
    history = PoolHistory()
    history.record({POOL: {"a": 1, "b": 0}})
    await anyio.sleep(2)
    history.record({POOL: {"a": 1, "b": 0}})  # the same shares: nothing new
    await anyio.sleep(3)
    history.record({POOL: {"a": 0, "b": 1}})
    await anyio.sleep(1)
    assert history.rows(POOL) == [
        {"ago_s": 6.0, "held": {"a": 1, "b": 0}},
        {"ago_s": 1.0, "held": {"a": 0, "b": 1}},
    ]
    assert history.rows("a host") == []  # a pool never seen has no history


async def test_records_older_than_the_span_go_but_what_held_as_it_began_stays() -> None:
    history = PoolHistory()
    for n in range(4):  # four changes a minute apart
        history.record({POOL: {"a": n}})
        await anyio.sleep(60)
    await anyio.sleep(SPAN_S - 60)  # the first three are now older than the window
    history.record({POOL: {"a": 9}})
    rows = history.rows(POOL)
    assert [r["held"]["a"] for r in rows] == [3, 9]  # 3: what it held as the window began
    assert rows[0]["ago_s"] == SPAN_S


async def test_a_pool_unchanged_past_the_span_shows_only_what_it_holds() -> None:
    history = PoolHistory()
    for n in range(3):
        history.record({POOL: {"a": n}})
        await anyio.sleep(60)
    await anyio.sleep(SPAN_S * 3)  # nothing changes for half an hour: nothing is recorded
    assert history.rows(POOL) == [{"ago_s": SPAN_S * 3 + 60, "held": {"a": 2}}]


async def test_a_pool_keeps_at_most_max_records_the_oldest_going_first() -> None:
    history = PoolHistory()
    for n in range(MAX_RECORDS + 100):
        history.record({POOL: {"a": n}})
        await anyio.sleep(0.5)  # all within the span
    rows = history.rows(POOL)
    assert len(rows) == MAX_RECORDS
    assert rows[0]["held"] == {"a": 100} and rows[-1]["held"] == {"a": MAX_RECORDS + 99}
