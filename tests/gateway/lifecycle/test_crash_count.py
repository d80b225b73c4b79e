"""How failures count toward the restart backoff (`crash.count_failure`, `crash.backoff_left`):
a row of failures ends once the instance has been ready `STEADY_S` in all since its last one,
in one stretch or in many (a spare serves in short stretches between its rests), and never
for an engine that fails as soon as it is up."""

from __future__ import annotations

from typing import cast

import pytest

from capyctl_gateway._deployments.routes import EngineInstance
from capyctl_gateway._lifecycle.crash import STEADY_S, backoff_left, count_failure
from capyctl_gateway._lifecycle.states import InstanceState, Launched

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def launched() -> Launched:
    """A launched instance's lifecycle record alone (the counting reads no instance)."""
    return Launched(cast(EngineInstance, None), since=0.0)


def up_then(lc: Launched, at: float, ready_s: float, then: InstanceState) -> float:
    """``lc`` ready at ``at`` for ``ready_s`` seconds, then ``then``; the time after."""
    lc.enter(InstanceState.READY, at)
    lc.enter(then, at + ready_s)
    return at + ready_s


async def test_failures_in_a_row_back_off_and_a_minute_of_serving_in_stretches_ends_the_row() -> (
    None
):
    lc = launched()
    now = 0.0
    for n in range(1, 5):  # up for a second at a time, failing each time: the backoff grows
        now = up_then(lc, now, 1.0, InstanceState.WAKING)
        count_failure(lc, now)
        assert lc.crashes == n
    assert backoff_left(lc, now) == 4.0  # 1 s after the second failure, doubling
    for _ in range(3):  # a spare's short stretches, parked between: 63 s ready in all
        now = up_then(lc, now + 100.0, 21.0, InstanceState.PARKING)
        lc.enter(InstanceState.PARKED, now)
    lc.enter(InstanceState.WAKING, now)
    count_failure(lc, now)
    assert lc.crashes == 1 and backoff_left(lc, now) == 0.0  # a new row: tried again at once


async def test_an_exit_after_a_steady_stretch_starts_afresh_and_one_just_short_of_it_does_not() -> (
    None
):
    lc = launched()
    count_failure(lc, 0.0)
    count_failure(lc, 1.0)
    lc.enter(InstanceState.READY, 2.0)
    count_failure(lc, 2.0 + STEADY_S)  # it exits while ready, having served a minute
    lc.enter(InstanceState.STOPPING, 2.0 + STEADY_S)  # its stop follows, as in crash.lost
    assert lc.crashes == 1 and lc.served_s == 0.0  # that minute is not counted twice
    lc.enter(InstanceState.READY, 100.0)
    count_failure(lc, 100.0 + STEADY_S - 1.0)
    assert lc.crashes == 2
