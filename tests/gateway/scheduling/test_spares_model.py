"""Spare instances under random schedules: hypothesis draws a deployment of two or three
launched instances (engines of the fake runner that run one request at a time), their start,
wake and park costs, whether a park keeps the process (``park: sleep``) or is a stop, the
spares' idle timeout, and a schedule of bursts and lulls (waves of one to six clients, some
hanging up, generations of 0.2 to 3 s, lulls long enough for spares to rest) with an
operator's park, stop and start among them, and in half the schedules half the spares' wakes
failing (a spare that failed is tried again after the crash backoff); each runs on the
virtual clock.

Checked at every transition: no spare begins its park or stop with a request running on it;
the budget (every instance's ready memory) is never exceeded. At the end: every request got
200 or a documented refusal within its deadline, every 200 whole unless an operator's stop
overlapped it; nothing is left starting, waking or parking; no spare's task is left; a
rested instance is parked or stopped.

CI runs the same schedules every time (hypothesis derandomized); ``CAPYCTL_SPARES_EXAMPLES``
runs more of them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from dataclasses import replace
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capyctl_gateway._lifecycle.rest import quiesce
from capyctl_gateway._lifecycle.states import InstanceState, Launched
from tests.gateway.conftest import KEY, VIRTUAL_CLOCK
from tests.gateway.fake_runner import FakeEngines, Script
from tests.gateway.scheduling.test_scheduling_model import (
    DEADLINE,
    ONCE,
    Seen,
    client,
    command,
    open_gateway,
)
from tests.gateway.scheduling.test_spares import config as spares_config

pytestmark = pytest.mark.anyio
anyio_backend = VIRTUAL_CLOCK
EXAMPLES = int(os.environ.get("CAPYCTL_SPARES_EXAMPLES", "24"))
DOCUMENTED = {409: {"deployment_stopped"}, 500: {"activation_failed"}, 503: {"unavailable"}}
UNDER_WAY = (InstanceState.STARTING, InstanceState.WAKING, InstanceState.PARKING)

schedules = st.fixed_dictionaries(
    {
        "instances": st.integers(2, 3),
        "sleeps": st.booleans(),
        "start": st.sampled_from([0.2, 1.0, 2.0]),
        "wake": st.sampled_from([0.1, 0.5, 1.0]),
        "park": st.sampled_from([0.0, 0.3]),
        "idle": st.sampled_from(["0.5s", "1s", "2s"]),
        "seed": st.integers(0, 2**32 - 1),
        "waves": st.integers(6, 16),
        "spare_fails": st.sampled_from([0.0, 0.5]),
    }
)


def waves(rng: random.Random, n: int) -> list[tuple[float, list[tuple[float, bool]], str | None]]:
    """Each wave: the lull before it, its clients (generation, hangs up) and an operator's
    command beside it (or None)."""
    out = []
    for _ in range(n):
        lull = rng.choice([0.0, 0.3, 1.0, 3.0])
        clients = [
            (rng.choice([0.2, 0.5, 1.0, 3.0]), rng.random() < 0.1) for _ in range(rng.randint(1, 6))
        ]
        verb = rng.choice(["park", "stop", "start"]) if rng.random() < 0.12 else None
        out.append((lull, clients, verb))
    return out


@pytest.mark.timeout(600)
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(schedule=schedules)
async def test_spares_under_random_schedules_keep_their_bounds(schedule: dict[str, Any]) -> None:
    name, n = "a", schedule["instances"]
    script = Script(start_s=schedule["start"], wake_s=schedule["wake"], park_s=schedule["park"])
    failing = replace(script, start_fails="out of memory", wake_fails="out of memory")
    engines, faults = FakeEngines({name: script}), random.Random(schedule["seed"] + 1)
    config = spares_config(
        n,
        park="sleep" if schedule["sleeps"] else "stop",
        spare_idle_timeout=schedule["idle"],
        drain_timeout="3s",
    )
    config["deployments"][0]["memory"] = {"ready": "1GiB"}
    config["resources"]["memory_budget"] = f"{n}GiB"
    config["queue"]["request_deadline"] = f"{DEADLINE}s"
    runner, url, lifecycle = await open_gateway(config, engines)
    life = lifecycle.lives[name]
    seen = Seen()

    def check(lc: Launched) -> None:
        if lifecycle.budget.held() > n * 2**30:
            seen.broken.append(f"{lifecycle.budget.held()} held against {n} GiB")
        down = (InstanceState.PARKING, InstanceState.STOPPING)
        if lc.rested and lc.state in down and lc.inst.ledger.running:
            seen.broken.append(f"{lc.inst.where}: a spare went {lc.state} with a request")
        if lc.state in (InstanceState.FAILED, InstanceState.READY):
            engines.scripts[name] = script
        elif lc.rested and lc.state in (InstanceState.STARTING, InstanceState.WAKING):
            fails = faults.random() < schedule["spare_fails"]  # this spare's wake fails
            engines.scripts[name] = failing if fails else script

    lifecycle.engines.observers.append(check)
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        async with (
            httpx.AsyncClient(base_url=url, headers=auth, timeout=DEADLINE + 30, limits=ONCE) as c,
            anyio.create_task_group() as play,
        ):
            for lull, clients, verb in waves(random.Random(schedule["seed"]), schedule["waves"]):
                await anyio.sleep(lull)  # the schedule's own pace
                for take, hang in clients:
                    play.start_soon(client, c, seen, 0, name, take, hang, 1)
                if verb is not None:
                    play.start_soon(command, lifecycle, seen, 0, name, verb)
        with anyio.fail_after(120):
            while life.activating or life.closing is not None or life.spare is not None:
                await quiesce(life)
                if (spare := life.spare) is not None:  # one the idle watch began last
                    await asyncio.wait([spare])
    finally:
        await runner.cleanup()
    left = [lc.state for lc in life.launched if lc.state in UNDER_WAY]
    stale = [lc.inst.where for lc in life.launched if lc.rested and lc.state is InstanceState.READY]
    assert seen.broken == [] and left == [] and stale == [], (schedule, seen.broken[:5], left)
    for a in seen.asks:
        if a.hang or a.status is None:
            continue
        assert a.ended - a.began <= DEADLINE + 1.0, (schedule, a)
        if a.status != 200:
            assert a.code in DOCUMENTED.get(a.status, set()), (schedule, a)
            continue
        stopped = any(s <= a.ended and e >= a.began for _, s, e in seen.stops)
        assert a.whole or stopped, (json.dumps(schedule), a)
