"""Spare instances (``_lifecycle/spares.py``), on the fake runner and the virtual clock: a
deployment of two launched instances, each engine running one request at a time
(``--max-running 1``, the rest wait in its queue as vLLM's do past ``--max-num-seqs``), a
spare parked alone once idle for ``spare_idle_timeout`` while the other serves, and a request
that wakes it only where the wait behind the ready one is longer than the wake.

- An idle instance is parked alone; the other stays ready; the budget holds its parked memory.
- A request whose expected wait is shorter than the wake queues; one whose is longer wakes
  the spare and is served there; the router line says which, with both figures.
- Many clients at once, with hang-ups and an operator's park and start beside them: every
  request is answered, no instance is parked or stopped with a request running on it, and
  nothing is left half way.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest
from rich.console import Console

from capyctl_gateway._errors import GatewayError
from capyctl_gateway._lifecycle.operator import operator_park, operator_start
from capyctl_gateway._lifecycle.states import InstanceState, Launched
from capyctl_gateway._management.render import print_status
from capyctl_gateway._management.status import deployment_status
from tests.eventually import eventually
from tests.gateway.conftest import FAKES, VIRTUAL_CLOCK, WORKERS, Gw
from tests.gateway.fake_runner import Script
from tests.gateway.lifecycle.test_lifecycle import ENGINE
from tests.gateway.lifecycle.test_lifecycle_races import said, served
from tests.gateway.scheduling.test_scheduling_model import ONCE

pytestmark = pytest.mark.anyio
workers = WORKERS
fakes = FAKES
anyio_backend = VIRTUAL_CLOCK
MakeGateway = Callable[..., Awaitable[Gw]]
GiB = 2**30


def config(instances: int = 2, **cycle: Any) -> dict[str, Any]:
    name = "a"
    launch = {
        "command": [*ENGINE, "--served", served(name), "--max-running", "1"],
        "startup_timeout": "60s",
    }
    dep = {
        "name": name,
        "engine": "vllm",
        "engine_version": "0.31.0",
        "served_model": served(name),
        "instances": [{"launch": launch} for _ in range(instances)],
        "memory": {"ready": "2GiB", "parked": "512MiB"},
        "lifecycle": {"park": "sleep", "spare_idle_timeout": "3s", **cycle},
    }
    return {
        "resources": {"memory_budget": f"{2 * instances}GiB"},
        "queue": {"request_deadline": "120s"},
        "deployments": [dep],
    }


async def send(c: httpx.AsyncClient, take: float) -> None:
    r = await c.post("/v1/chat/completions", json=said(f"take:{take}", "a"))
    assert r.status_code == 200, r.text


def spares(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The ``spare`` field of each router line, in order."""
    lines = [getattr(r, "fields", {}) for r in caplog.records]
    return [f["spare"] for f in lines if f.get("spare") is not None]


async def rested(gw: Gw) -> Launched:
    """Wait until one instance of ``a`` is parked as a spare, the other ready; the spare."""
    life = gw.gateway.fleet.lifecycle.lives["a"]

    def one_rests() -> bool:
        states = sorted(lc.state for lc in life.launched)
        return states == [InstanceState.PARKED, InstanceState.READY] and life.spare is None

    await eventually(one_rests, within=60)
    return next(lc for lc in life.launched if lc.rested)


async def test_an_idle_instance_rests_alone_and_a_long_wait_wakes_it(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """Both instances serve a request each; 3 s after, one is parked alone (the deployment
    serves on: the budget holds 2 GiB and 512 MiB). With the wake measured at 1 s and each
    request running 2 s: a request that finds the ready engine running one with none waiting
    goes there (an expected wait of nothing); the next, with one waiting there, would wait
    (1 + 1) x 2 s / 1 = 4 s: it wakes the spare (1 s) and runs there."""
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    gw = await make_gateway(config())
    assert gw.fakes is not None
    gw.fakes.scripts["a"] = Script(wake_s=1.0)
    lifecycle = gw.gateway.fleet.lifecycle
    life = lifecycle.lives["a"]
    async with gw.client(timeout=300, limits=ONCE) as c:
        async with anyio.create_task_group() as tg:
            tg.start_soon(send, c, 2)
            tg.start_soon(send, c, 2)
        spare = await rested(gw)
        assert lifecycle.budget.held() == 2 * GiB + 512 * 2**20
        assert _marked(gw) == [spare.inst.index]
        lifecycle.scheduler.costs.last[("a", "wake")] = 1.0  # as if a wake had been measured
        ready = next(lc for lc in life.launched if not lc.rested)
        async with anyio.create_task_group() as tg:
            await fill(tg, ready, partial(send, c))
            began = anyio.current_time()
            await send(c, 2)
            took = anyio.current_time() - began
        assert spare.state is InstanceState.READY and not spare.rested
        assert _marked(gw) == []
    chose = [(s["chose"], s["why"]) for s in spares(caplog)]
    assert chose[-3:] == [
        ("queue", "the wait is shorter than the wake"),
        ("queue", "the wait is shorter than the wake"),
        ("wake", f"woke instance {spare.inst.index}"),
    ], chose
    assert spares(caplog)[-1]["wait_s"] == pytest.approx(4.0, rel=0.2)
    assert 1.0 + 2.0 <= took <= 1.0 + 2.0 + 0.5, took  # not 4 s behind the others first


def _marked(gw: Gw) -> list[int]:
    """The instances of ``a`` that `status` marks as spares, in its document and its text."""
    doc = deployment_status(gw.gateway.fleet, "a")
    assert doc is not None
    console = Console(width=100, record=True, force_terminal=False)
    print_status(console, doc)
    text = console.export_text()
    marked = [i["index"] for i in doc["instances"] if i.get("spare")]
    assert text.count("ready (parked), a spare") == text.count("  parked, a spare") == len(marked)
    return marked


async def fill(
    tg: anyio.abc.TaskGroup, ready: Launched, sender: Callable[[float], Coroutine[Any, Any, None]]
) -> None:
    """Two requests of 2 s for the ready instance, ``sender(2)`` each: one runs, one waits in
    its engine, as its samples show before this returns."""
    tg.start_soon(sender, 2)
    await eventually(lambda: _sampled(ready, running=1, waiting=0))
    tg.start_soon(sender, 2)
    await eventually(lambda: _sampled(ready, running=1, waiting=1))


def _sampled(lc: Launched, *, running: int, waiting: int) -> bool:
    s = lc.inst.runner.sample()
    return s is not None and (s.running, s.waiting) == (running, waiting)


async def test_without_a_measured_wait_a_request_queues(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """An instance that has completed no request has no time per request: a request for the
    deployment does not wake the spare on a guess, and its router line says why."""
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    gw = await make_gateway(config())
    lifecycle = gw.gateway.fleet.lifecycle
    async with gw.client(timeout=300, limits=ONCE) as c:
        await send(c, 0.1)
        spare = await rested(gw)
        for lc in lifecycle.lives["a"].launched:
            lc.inst.ledger.per_request_s = None
        await send(c, 0.1)
    assert spare.state is InstanceState.PARKED
    last = spares(caplog)[-1]
    assert last["chose"] == "queue" and last["wait_s"] is None
    assert last["why"] == "the ready instances' wait is not measured yet"


async def test_spares_under_many_clients_hang_ups_and_an_operator(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """Three instances, spares resting after 1 s idle, each wake 0.5 s: 30 clients in waves
    (some hang up before their answer), an operator's park and start beside them. Spares rest
    and requests wake them; every request that stayed is answered 200; no instance began a
    park or stop with a request running on it; at the end nothing is parking, waking or
    starting, and no spare's task is left."""
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    gw = await make_gateway(config(3, spare_idle_timeout="1s"))
    assert gw.fakes is not None
    gw.fakes.scripts["a"] = Script(wake_s=0.5, park_s=0.2)
    lifecycle = gw.gateway.fleet.lifecycle
    life = lifecycle.lives["a"]
    broken: list[str] = []
    rests = 0

    def watch(lc: Launched) -> None:
        nonlocal rests
        rests += lc.rested and lc.state is InstanceState.PARKING  # a spare's own park
        down = (InstanceState.PARKING, InstanceState.STOPPING)
        if lc.state in down and lc.inst.ledger.running:
            broken.append(f"{lc.inst.where} went {lc.state} with {lc.inst.ledger.running} running")

    lifecycle.engines.observers.append(watch)
    statuses: list[int] = []

    async def client(c: httpx.AsyncClient, take: float, hang: bool) -> None:
        if hang:
            with anyio.move_on_after(0.3):
                await c.post("/v1/chat/completions", json=said(f"take:{take}", "a"))
            return
        r = await c.post("/v1/chat/completions", json=said(f"take:{take}", "a"))
        statuses.append(r.status_code)

    async with gw.client(timeout=300, limits=ONCE) as c:
        for wave in range(5):
            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(client, c, 0.5 + (i % 3), i % 4 == 3)
                    await anyio.sleep(0.3)  # the wave's own pace: the engines' samples follow
                if wave == 2:
                    with contextlib.suppress(GatewayError):
                        await operator_park(lifecycle, "a", known=True)
                    await operator_start(lifecycle, "a", known=True)
            await anyio.sleep(2.5)  # the spares' idle time passes (the virtual clock)
    assert statuses and set(statuses) == {200}, statuses
    woke = [s for s in spares(caplog) if s["why"].startswith("woke instance")]
    assert rests and woke, (rests, spares(caplog))  # spares rested, and requests woke them
    assert broken == []
    coming = (InstanceState.PARKING, InstanceState.WAKING, InstanceState.STARTING)
    assert all(lc.state not in coming for lc in life.launched)
    assert life.spare is None and not life.activating
