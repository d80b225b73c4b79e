"""The scheduler for the memory budget (``_scheduling/``), on the fake runner and the virtual
clock: two deployments under a budget for one, each start 2 s, each generation 1 s (``take:1``),
as agents drive them.

- Of two idle deployments, the one whose clients are likely to miss it least goes.
- Two closed-loop agents taking turns: ``on_arrival`` (the gateway before it) starts an engine
  for every request, ``collate`` (llama-swap's collation) too, ``cost_aware`` twice in all.
- A steady stream and a trickle: the trickle's request is switched in at the fairness bound
  (``resources.max_switch_wait``), however busy the stream keeps the other.
- A busy deployment is switched out once a waiting request has waited ``switch_patience`` times
  the switch's measured cost; an idle one once it has been quiet longer than its clients pause.
- Priorities: a request's orders its deployment's queue, a deployment's orders switches
  between deployments that wait.
- What the scheduler means to do shows in ``list`` (per pool) and its switches in the metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest
from rich.console import Console

from capyctl_gateway._clock import stamp
from capyctl_gateway._lifecycle.operator import deployments_list, operator_park
from capyctl_gateway._management.metrics import exposition
from capyctl_gateway._management.render import print_list
from tests.eventually import eventually
from tests.gateway.conftest import FAKES, VIRTUAL_CLOCK, WORKERS, Gw
from tests.gateway.fake_runner import Script
from tests.gateway.lifecycle.test_lifecycle import launched
from tests.gateway.lifecycle.test_lifecycle_races import said, served

pytestmark = pytest.mark.anyio
workers = WORKERS
fakes = FAKES
anyio_backend = VIRTUAL_CLOCK  # every engine and client runs in this process
MakeGateway = Callable[..., Awaitable[Gw]]
GiB = 2**30


def config(*names: str, switching: str = "cost_aware", **resources: Any) -> dict[str, Any]:
    memory = {"ready": "1GiB"}
    deps = [
        launched(n, served=served(n), memory=memory, extra=["--slow-start", "2"]) for n in names
    ]
    return {
        "resources": {"memory_budget": "1GiB", "switching": switching, **resources},
        "queue": {"request_deadline": "120s"},
        "deployments": deps,
    }


async def send(c: httpx.AsyncClient, name: str, take: float) -> None:
    """One request for ``name``, a generation of ``take`` seconds; it must be served."""
    r = await c.post("/v1/chat/completions", json=said(f"take:{take}", name))
    assert r.status_code == 200, r.text


async def stream(tg: anyio.abc.TaskGroup, c: httpx.AsyncClient, name: str, count: int) -> None:
    """A steady stream for ``name``: ``count`` requests of 1 s, one every 0.5 s (its own pace,
    not synchronisation), each a task of ``tg``."""
    for _ in range(count):
        tg.start_soon(send, c, name, 1)
        await anyio.sleep(0.5)


async def agent(c: httpx.AsyncClient, name: str, turns: int, waits: list[float]) -> None:
    """A closed-loop client: its next request as soon as the last is answered."""
    for _ in range(turns):
        began = stamp()
        r = await c.post("/v1/chat/completions", json=said("take:1", name))
        assert r.status_code == 200, r.text
        waits.append(stamp() - began)


@pytest.mark.parametrize("switching", ["on_arrival", "collate", "cost_aware"])
async def test_two_agents_taking_turns_start_an_engine_per_request_only_without_the_scheduler(
    make_gateway: MakeGateway, switching: str
) -> None:
    gw = await make_gateway(config("a", "b", switching=switching))
    waits: list[float] = []
    async with gw.client(timeout=300) as c, anyio.create_task_group() as tg:
        for name in ("a", "b"):
            tg.start_soon(agent, c, name, 6, waits)
    assert gw.fakes is not None
    starts = sum(gw.fakes.starts.values())
    assert len(waits) == 12
    if switching == "cost_aware":
        assert starts == 2  # each in once, its agent served while it stays in
    else:
        assert starts == 12  # every request a cold start: the thrash the scheduler ends


async def test_a_trickle_is_switched_in_at_the_fairness_bound_however_busy_the_other(
    make_gateway: MakeGateway,
) -> None:
    """A steady stream for a (a new request every 0.5 s, each 1 s: a never idles) and one
    request for b: b waits the fairness bound (5 s here), then one switch (a's running requests
    drain, 1 s; b starts, 2 s), and no longer (then its own 1 s generation)."""
    gw = await make_gateway(config("a", "b", max_switch_wait="5s", switch_patience=100))
    waited: list[float] = []
    async with gw.client(timeout=300) as c, anyio.create_task_group() as tg:
        tg.start_soon(stream, tg, c, "a", 40)
        await anyio.sleep(6)  # a has been in, busy, for a while
        await agent(c, "b", 1, waited)
    (w,) = waited
    assert 5.0 + 1.0 <= w <= 5.0 + 1.0 + 2.0 + 1.0 + 0.1, w
    assert gw.gateway.fleet.lifecycle.scheduler.switches["fairness"] >= 1  # b in, then a back


async def test_a_busy_deployment_goes_once_a_request_waited_its_patience(
    make_gateway: MakeGateway,
) -> None:
    """With both starts measured (2 s), a request for b waits twice the switch (4 s) while a's
    stream keeps it busy, then a drains (its 1 s generations), b starts (2 s) and answers
    (1 s)."""
    gw = await make_gateway(config("a", "b"))
    lifecycle = gw.gateway.fleet.lifecycle
    waited: list[float] = []
    async with gw.client(timeout=300) as c:
        await agent(c, "b", 1, [])
        await agent(c, "a", 1, [])  # both starts measured now; a is in
        async with anyio.create_task_group() as tg:
            tg.start_soon(stream, tg, c, "a", 30)
            await anyio.sleep(2)
            await agent(c, "b", 1, waited)
            tg.cancel_scope.cancel()
    (w,) = waited
    assert 4.0 + 2.0 + 1.0 <= w <= 4.0 + 1.0 + 2.0 + 1.0 + 0.1, w
    assert lifecycle.scheduler.switches["waited"] == 1
    assert lifecycle.scheduler.costs.last[("b", "start")] == pytest.approx(2.0, abs=0.2)


async def test_an_idle_deployment_goes_once_it_is_quieter_than_its_clients_are(
    make_gateway: MakeGateway,
) -> None:
    """a answered one request and nothing since: b's request waits until a has been quiet for
    2 s (its clients' pauses not measured yet, shorter than the switch), then b starts."""
    gw = await make_gateway(config("a", "b"))
    waited: list[float] = []
    async with gw.client(timeout=300) as c:
        await agent(c, "a", 1, [])
        await agent(c, "b", 1, waited)
    (w,) = waited
    assert 2.0 + 2.0 + 1.0 <= w <= 2.0 + 2.0 + 1.0 + 0.1, w
    assert gw.gateway.fleet.lifecycle.scheduler.switches["idle"] == 1


async def test_of_two_idle_deployments_the_one_its_clients_miss_least_goes(
    make_gateway: MakeGateway,
) -> None:
    """A budget for two: hot's agent pauses 0.1 s between its 1 s requests, warm answered one
    request 10 s ago. c's request comes in a pause of hot's that lasts past hot's grace (0.5 s),
    and hot's stop is the cheaper: yet warm goes (hot's clients are back within a second, warm's
    have not been for 10 s), and hot is never started twice."""
    cfg = config("hot", "warm", "c")
    cfg["resources"]["memory_budget"] = "2GiB"
    gw = await make_gateway(cfg)
    assert gw.fakes is not None
    gw.fakes.scripts.update(hot=Script(stop_s=0.5), warm=Script(stop_s=1.0))
    stopped: list[str] = []
    gw.gateway.fleet.lifecycle.engines.observers.append(
        lambda lc: stopped.append(lc.inst.deployment) if lc.state.value == "stopped" else None
    )
    lifecycle = gw.gateway.fleet.lifecycle
    async with gw.client(timeout=300) as c:
        for name in ("hot", "warm"):  # each stop measured: hot's 0.5 s, warm's 1 s
            await agent(c, name, 1, [])
            await operator_park(lifecycle, name, known=True)
        stopped.clear()
        before = dict(gw.fakes.starts)
        await agent(c, "warm", 1, [])
        for _ in range(8):  # hot's clients: back within 0.1 s
            await agent(c, "hot", 1, [])
            await anyio.sleep(0.1)
        await anyio.sleep(0.1)  # a longer pause than hot's usual, past its grace
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent, c, "c", 1, [])
            await anyio.sleep(0.9)  # the schedule's own pace
            tg.start_soon(agent, c, "hot", 1, [])
    assert stopped == ["warm"], stopped
    assert gw.fakes.starts - Counter(before) == Counter(
        {"hot/0": 1, "warm/0": 1, "c/0": 1}
    )  # hot once
    assert lifecycle.scheduler.switches["idle"] == 1


async def test_a_requests_priority_orders_its_deployments_queue(make_gateway: MakeGateway) -> None:
    dep = launched("a", served=served("a"))
    gw = await make_gateway(
        {
            "queue": {"max_running_per_deployment": 1, "request_deadline": "60s"},
            "deployments": [dep],
        }
    )
    order: list[int] = []
    async with gw.client(timeout=60) as c, anyio.create_task_group() as tg:

        async def ask(priority: int | None) -> None:
            body = said("take:1", "a") | ({} if priority is None else {"priority": priority})
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            order.append(0 if priority is None else priority)

        tg.start_soon(ask, None)  # runs first, holding the one slot
        await eventually(lambda: gw.gateway.fleet.routes["a"].queue.running == 1)
        queue = gw.gateway.fleet.routes["a"].queue
        for n, p in enumerate((5, -3, 1, 5), 1):
            tg.start_soon(ask, p)

            def lined_up(n: int = n) -> bool:  # in line before the next comes
                return queue.waiting == n

            await eventually(lined_up)
    assert order == [0, -3, 1, 5, 5]


@pytest.mark.parametrize("priority", [1.5, True, "1", 2**31, None])
async def test_a_priority_that_is_no_whole_number_is_refused(
    make_gateway: MakeGateway, priority: Any
) -> None:
    gw = await make_gateway({"deployments": [launched("a", served=served("a"))]})
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=said("hi", "a") | {"priority": priority})
    assert r.status_code == 400 and r.json()["code"] == "invalid_request", r.text
    assert "priority must be a whole number" in r.json()["message"]
    assert gw.fakes is not None and sum(gw.fakes.starts.values()) == 0  # no engine saw it


async def test_a_deployments_priority_orders_the_switches_that_wait(
    make_gateway: MakeGateway,
) -> None:
    """a is in and busy; b (priority 5) asks first, c (priority 0) next: c is switched in
    first, then b."""
    cfg = config("a", "b", "c", switch_patience=1)
    cfg["deployments"][1]["lifecycle"] = {"priority": 5}
    gw = await make_gateway(cfg)
    ready: list[str] = []
    gw.gateway.fleet.lifecycle.engines.observers.append(
        lambda lc: ready.append(lc.inst.deployment) if lc.state.value == "ready" else None
    )
    async with gw.client(timeout=300) as c:
        await agent(c, "a", 1, [])
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent, c, "a", 8, [])
            await anyio.sleep(0.5)
            tg.start_soon(agent, c, "b", 1, [])
            await anyio.sleep(0.5)
            tg.start_soon(agent, c, "c", 1, [])
    assert ready[:1] == ["a"] and ready.index("c") < ready.index("b"), ready


async def test_list_and_metrics_show_the_scheduler(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(config("a", "b"))
    fleet = gw.gateway.fleet
    async with gw.client(timeout=300) as c, anyio.create_task_group() as tg:
        await agent(c, "a", 1, [])
        tg.start_soon(send, c, "a", 8)  # a stays busy
        await eventually(lambda: fleet.routes["a"].queue.running == 1)
        tg.start_soon(agent, c, "b", 1, [])
        await eventually(lambda: fleet.lifecycle.scheduler.intents.get("this machine"))
        listing = deployments_list(fleet.lifecycle, fleet.routes, GiB)
        (pool,) = listing["pools"]
        assert pool["resident"] == ["a"]
        (waits,) = pool["waiting"]
        assert waits["name"] == "b" and waits["requests"] == 1
        nxt = pool["next_switch"]
        assert (nxt["out"], nxt["in"]) == ("a", "b") and nxt["in_s"] is not None
        text = Console(width=200, record=True)
        print_list(text, listing)
        shown = text.export_text()
        assert "this machine: deployment b waits to be switched in (1 requests" in shown
        assert "this machine: next switch: a out, b in, within" in shown
    exposed = exposition(gw.gateway).decode()  # a went quiet once its 8 s generation ended
    assert 'capyctl_switches_total{reason="idle"} 1.0' in exposed
    assert 'capyctl_lifecycle_seconds_total{deployment="b",phase="starting"}' in exposed
