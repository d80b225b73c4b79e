"""The scheduler's model test: hypothesis draws whole schedules (three to five deployments of
the fake runner, their start costs, failing starts and sizes (1 or 2 GiB) under a budget of 2
or 3 GiB, closed-loop agents and lone requests with their generations, clients that hang up,
operator starts, stops and parks), and each runs against a gateway on the virtual clock
(``tests/vclock.py``), so a schedule of minutes runs in the time its own work takes. Thousands of steps a CI run.

Checked throughout, at every lifecycle transition and every tick of a watcher (0.25 s of the
clock):

- the memory budget is never exceeded, in the ledger and in the engines that really serve;
- nothing waits while the resident set is idle: a deployment whose requests wait to be switched
  in never waits past the moment the policy itself says every idle resident one has gone quiet
  (its grace, `policy.grace`), plus a tick;

and at the end of each schedule:

- every request got 200 or a documented refusal, and never after its deadline;
- a running generation is never cut by a switch: every 200 was whole, where no operator's
  stop or crash could have cut it;
- no request waited past ``max_switch_wait`` plus the switches ahead of it for a switch it was
  owed (each: a drain within ``drain_timeout``, a stop, a start).

CI runs the same schedules every time (hypothesis derandomized); ``CAPYCTL_SCHED_EXAMPLES`` runs
more of them, ``CAPYCTL_SCHED_SEED`` other ones. A failing one prints itself as JSON, and
``CAPYCTL_SCHED_REPLAY='<that JSON>'`` runs it again.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from capyctl_gateway._clock import stamp
from capyctl_gateway._config import GatewayConfig
from capyctl_gateway._errors import GatewayError
from capyctl_gateway._http.app import GATEWAY_KEY, create_app
from capyctl_gateway._lifecycle.controller import Lifecycle
from capyctl_gateway._lifecycle.operator import operator_park, operator_start, operator_stop
from capyctl_gateway._lifecycle.rest import quiesce
from capyctl_gateway._scheduling.policy import grace
from tests.gateway.conftest import COLLECTOR, KEY, VIRTUAL_CLOCK, _serve
from tests.gateway.fake_runner import FakeEngines, Script, fake_kinds
from tests.gateway.lifecycle.test_lifecycle import launched
from tests.gateway.lifecycle.test_lifecycle_races import said, served

pytestmark = pytest.mark.anyio
anyio_backend = VIRTUAL_CLOCK
EXAMPLES = int(os.environ.get("CAPYCTL_SCHED_EXAMPLES", "24"))
SEED = os.environ.get("CAPYCTL_SCHED_SEED")
"""Draw other schedules than CI's (hypothesis's seed)."""
REPLAY = json.loads(os.environ.get("CAPYCTL_SCHED_REPLAY", "null"))
"""One schedule to run again, as a failure prints it (JSON: ``failing`` a list)."""
MAX_WAIT = 6.0
DRAIN = 3.0
DEADLINE = 90.0
TICK = 0.25
ONCE = httpx.Limits(max_keepalive_connections=0)
DOCUMENTED = {409: {"deployment_stopped"}, 500: {"activation_failed"}, 503: {"unavailable"}}


@dataclass
class Ask:
    dep: int
    take: float
    hang: bool
    began: float = 0.0
    ended: float = 0.0
    status: int | None = None
    code: str | None = None
    whole: bool = False


@dataclass
class Seen:
    broken: list[str] = field(default_factory=list)
    asks: list[Ask] = field(default_factory=list)
    stops: list[tuple[int, float, float]] = field(default_factory=list)
    """(deployment, began, ended) of each operator stop or park."""
    failed_starts: set[int] = field(default_factory=set)


schedules = st.fixed_dictionaries(
    {
        "deps": st.integers(3, 5),
        "slots": st.integers(2, 3),
        "sizes": st.lists(st.sampled_from([1, 2, 2]), min_size=5, max_size=5),
        "starts": st.lists(st.sampled_from([0.2, 0.5, 1.0, 2.0, 4.0]), min_size=5, max_size=5),
        "failing": st.sets(st.integers(0, 4), max_size=1),
        "seed": st.integers(0, 2**32 - 1),
        "steps": st.integers(60, 160),
        "spares": st.booleans(),
    }
)


def steps(rng: random.Random, n: int, deps: int) -> list[tuple[float, str, int, float, bool]]:
    """(gap, kind, deployment, take, hang): kind ``agent`` (a closed-loop client of 2-6 turns),
    ``ask`` (one request), ``stop``, ``start`` or ``park``."""
    out = []
    hot = rng.randrange(deps)  # skewed: one deployment gets most of the traffic
    for _ in range(n):
        dep = hot if rng.random() < 0.5 else rng.randrange(deps)
        roll = rng.random()
        kind = (
            "agent"
            if roll < 0.25
            else "ask"
            if roll < 0.9
            else rng.choice(["stop", "start", "park"])
        )
        take = rng.choice([0.0, 0.2, 0.5, 1.0, 3.0])
        out.append((rng.uniform(0.0, 0.6), kind, dep, take, rng.random() < 0.08))
    return out


@pytest.mark.timeout(600)
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # CAPYCTL_SCHED_SEED's seed overrides it
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(schedule=st.just(REPLAY) if REPLAY else schedules)
@seed(int(SEED) if SEED else None)  # None: no seed, derandomized
async def test_the_scheduler_under_random_schedules_keeps_its_bounds(
    schedule: dict[str, Any],
) -> None:
    n = schedule["deps"]
    names = [chr(ord("a") + i) for i in range(n)]
    engines = FakeEngines(
        {
            name: Script(
                start_s=schedule["starts"][i],
                start_fails="no GPU" if i in schedule["failing"] else None,
            )
            for i, name in enumerate(names)
        }
    )
    deps = [
        launched(
            name,
            served=served(name),
            memory={"ready": f"{schedule['sizes'][i]}GiB"},
            lifecycle={"drain_timeout": f"{DRAIN}s"},
        )
        for i, name in enumerate(names)
    ]
    if schedule.get("spares"):  # a's two instances of 1 GiB, each running one request at once
        spare_out(deps[0], schedule)
    config = {
        "resources": {
            "memory_budget": f"{schedule['slots']}GiB",
            "max_switch_wait": f"{MAX_WAIT}s",
        },
        "queue": {"request_deadline": f"{DEADLINE}s"},
        "deployments": deps,
    }
    runner, url, lifecycle = await open_gateway(config, engines)
    seen = Seen(failed_starts=set(schedule["failing"]))
    schedule = schedule | {"failing": set(schedule["failing"])}
    budget = schedule["slots"] * 2**30
    size = {served(name): schedule["sizes"][i] for i, name in enumerate(names)}

    def check(lc: Any) -> None:
        if lifecycle.budget.held() > budget:
            seen.broken.append(f"{lifecycle.budget.held()} held against {budget}")
        serving = sum(size[model] for model in engines.live.values())
        if serving > schedule["slots"]:
            seen.broken.append(f"engines of {serving} GiB serve under {schedule['slots']} GiB")

    lifecycle.engines.observers.append(check)
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        async with (
            # A connection per request: httpx times its pool's keep-alive on real time, the
            # gateway on the virtual clock, so a pooled connection could be closed by the
            # gateway's keep-alive timeout just as a request is written on it (a ReadError).
            httpx.AsyncClient(base_url=url, headers=auth, timeout=DEADLINE + 30, limits=ONCE) as c,
            anyio.create_task_group() as tg,
        ):
            watcher = anyio.CancelScope()

            async def watch() -> None:
                with watcher:
                    while True:
                        await anyio.sleep(TICK)
                        idle_wait(lifecycle, seen)

            tg.start_soon(watch)
            async with anyio.create_task_group() as play:
                for gap, kind, dep, take, hang in steps(
                    random.Random(schedule["seed"]), schedule["steps"], n
                ):
                    await anyio.sleep(gap)  # the schedule's own pace
                    name = names[dep]
                    if kind in ("ask", "agent"):
                        turns = (
                            random.Random(schedule["seed"] + len(seen.asks)).randint(2, 6)
                            if kind == "agent"
                            else 1
                        )
                        play.start_soon(client, c, seen, dep, name, take, hang, turns)
                    else:
                        play.start_soon(command, lifecycle, seen, dep, name, kind)
            for life in lifecycle.lives.values():
                with anyio.fail_after(120):
                    await quiesce(life)
            watcher.cancel()
    finally:
        await runner.cleanup()
    if seen.broken:  # to run it again: CAPYCTL_SCHED_REPLAY='<this>'
        print("SCHEDULE", json.dumps(schedule | {"failing": sorted(schedule["failing"])}))  # noqa: T201
    assert seen.broken == [], (schedule, seen.broken[:5])
    judge(seen, schedule, names)


async def open_gateway(
    config: dict[str, Any], engines: FakeEngines
) -> tuple[web.AppRunner, str, Lifecycle]:
    """A gateway of ``config`` whose engines are ``engines`` (the fake runner's), on a loopback
    port: its runner (the caller cleans it up), its URL and its lifecycle."""
    app = create_app(
        GatewayConfig.model_validate(config),
        KEY,
        env={},
        collector_options=COLLECTOR,
        runners=fake_kinds(engines),
    )
    runner, url = await _serve(app, gateway=True)
    return runner, url, app[GATEWAY_KEY].fleet.lifecycle


def spare_out(dep: dict[str, Any], schedule: dict[str, Any]) -> None:
    """Make ``dep`` two instances that rest alone once idle for 0.5 s, whose engines run one
    request at a time (the rest wait in the engine: what a spare's wake is weighed against)."""
    launch = dep["instances"][0]["launch"]
    launch["command"] = [*launch["command"], "--max-running", "1"]
    dep["instances"] = [{"launch": dict(launch)}, {"launch": dict(launch)}]
    dep["memory"] = {"ready": "1GiB"}
    dep["lifecycle"] = dep["lifecycle"] | {"spare_idle_timeout": "0.5s"}
    schedule["sizes"] = [1, *schedule["sizes"][1:]]


def idle_wait(lifecycle: Any, seen: Seen) -> None:
    """The deployment first in line to be switched in waits while every idle resident one has
    been quiet past the policy's own grace (and a tick): the wake-up the scheduler missed.
    (Of several idle, the policy may wait for the one its clients are least likely to miss;
    its grace is never longer than the switch.)"""
    now = stamp()
    costs = lifecycle.scheduler.costs
    if lifecycle.budget.promised("this machine"):
        return  # a switch is under way: its drain, stop and start are what waits now
    blocked = [
        life for life in lifecycle.lives.values() if life.blocked and life.route.queue.waiting
    ]
    first = min(  # the one that goes first (the policy's order: priority, then the oldest)
        blocked,
        key=lambda life: (life.deployment.lifecycle.priority, life.route.queue.oldest or now),
        default=None,
    )
    for into in [first] if first is not None else []:
        waited = now - (into.route.queue.oldest or now)
        quiet: dict[str, tuple[float, float]] = {}  # each idle resident: quiet for, its grace
        for other in lifecycle.lives.values():
            queue = other.route.queue
            if other is into or not other.ready or other.closing is not None or not queue.quiet:
                continue
            quiet_for = now - max(queue.idle_since, *(lc.since for lc in other.launched))
            limit = grace(other, costs.switch(other, into)) + 2 * TICK
            quiet[other.deployment.name] = (quiet_for, limit)
        if quiet and all(f > lim and waited > lim for f, lim in quiet.values()):
            seen.broken.append(
                f"{into.deployment.name} waits {waited:.2f} s while {quiet} are quiet"
            )


async def client(
    c: httpx.AsyncClient, seen: Seen, dep: int, name: str, take: float, hang: bool, turns: int
) -> None:
    for _ in range(turns):
        a = Ask(dep, take, hang)
        seen.asks.append(a)
        a.began = stamp()
        try:
            if hang:  # the client hangs up before its answer's head
                with anyio.move_on_after(0.3):
                    await c.post("/v1/chat/completions", json=said(f"take:{take}", name))
                return
            body = said(f"take:{take}", name) | {"stream": True}
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                a.status = r.status_code
                text = (await r.aread()).decode()
                if r.status_code != 200:
                    a.code = r.json().get("code") if text.startswith("{") else None
                else:
                    a.whole = "data: [DONE]" in text and '"error"' not in text
        finally:
            a.ended = stamp()
        if a.status != 200:
            return


async def command(lifecycle: Any, seen: Seen, dep: int, name: str, verb: str) -> None:
    """An operator's command, through the lifecycle's own operator functions."""
    fn = {"stop": operator_stop, "start": operator_start, "park": operator_park}[verb]
    began = stamp()
    with anyio.move_on_after(DEADLINE + 60) as scope:  # a start waits until ready or failed
        with contextlib.suppress(GatewayError):  # a documented refusal (409, 503): no change
            await fn(lifecycle, name, known=True)
    if scope.cancelled_caught:
        seen.broken.append(f"an operator's {verb} of {name} had not ended after {DEADLINE + 60} s")
    if verb in ("stop", "park"):
        seen.stops.append((dep, began, stamp()))


def judge(seen: Seen, schedule: dict[str, Any], names: list[str]) -> None:
    slowest = max(schedule["starts"])
    ahead = len(names)  # switches that may be ahead of a request's own
    bound = MAX_WAIT + ahead * (DRAIN + slowest + 0.5) + 1.0
    for a in seen.asks:
        if a.hang or a.status is None:
            continue
        assert a.ended - a.began <= DEADLINE + 1.0, (a, "answered after its deadline")
        if a.status != 200:
            assert a.code in DOCUMENTED.get(a.status, set()), (a, "an undocumented answer")
            continue
        stopped = any(d == a.dep and s <= a.ended and e >= a.began for d, s, e in seen.stops)
        if not stopped:
            assert a.whole, (a, "a generation cut by neither a stop nor a crash")
            waited = a.ended - a.began - a.take
            assert waited <= bound, (a, f"waited {waited:.1f} s, past {bound:.1f} s")
