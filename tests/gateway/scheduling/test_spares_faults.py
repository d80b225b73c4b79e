"""Spare instances when something goes wrong (``_lifecycle/spares.py``), on the fake runner
and the virtual clock, with `test_spares`'s deployment of two launched instances:

- an operator's stop during a spare's wake stops everything, the wake's request answered;
- a wake that fails leaves its request to the ready instance, and the spare is tried again
  after the crash backoff;
- a budget with no room for the spare, and no ready instance that takes requests.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import httpx
import pytest

from capyctl_gateway._lifecycle.operator import operator_stop
from capyctl_gateway._lifecycle.states import DeploymentLife, InstanceState, Launched
from tests.eventually import eventually
from tests.gateway.conftest import FAKES, VIRTUAL_CLOCK, WORKERS, Gw
from tests.gateway.fake_runner import Script
from tests.gateway.lifecycle.test_lifecycle import ENGINE
from tests.gateway.lifecycle.test_lifecycle_races import said, served
from tests.gateway.scheduling.test_scheduling_model import ONCE
from tests.gateway.scheduling.test_spares import (
    GiB,
    MakeGateway,
    config,
    fill,
    rested,
    send,
    spares,
)

pytestmark = pytest.mark.anyio
workers = WORKERS
fakes = FAKES
anyio_backend = VIRTUAL_CLOCK


@dataclass
class OneRests:
    """A gateway on two instances of ``a``, one rested as a spare, the other ready."""

    gw: Gw
    c: httpx.AsyncClient
    life: DeploymentLife
    spare: Launched
    ready: Launched

    def script(self, **how: Any) -> None:
        """How ``a``'s fake engines behave from now (`Script`)."""
        assert self.gw.fakes is not None
        self.gw.fakes.scripts["a"] = Script(**how)


@contextlib.asynccontextmanager
async def one_rests(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture, cfg: dict[str, Any] | None = None
) -> AsyncIterator[OneRests]:
    """A gateway on ``cfg`` (`config()`), router lines logged: both instances serve a request
    of 2 s, then one rests; the start and a wake are priced at 1 s (as if measured), so that a
    wait of 4 s behind the ready one wakes the spare."""
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    gw = await make_gateway(config() if cfg is None else cfg)
    life = gw.gateway.fleet.lifecycle.lives["a"]
    async with gw.client(timeout=300, limits=ONCE) as c:
        async with anyio.create_task_group() as tg:
            tg.start_soon(send, c, 2)
            tg.start_soon(send, c, 2)
        spare = await rested(gw)
        costs = gw.gateway.fleet.lifecycle.scheduler.costs
        costs.last[("a", "wake")] = costs.last[("a", "start")] = 1.0
        ready = next(lc for lc in life.launched if not lc.rested)
        yield OneRests(gw, c, life, spare, ready)


@pytest.mark.parametrize("drain", ["30s", "1s"])
async def test_an_operators_stop_during_a_spares_wake_stops_everything(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture, drain: str
) -> None:
    """A request wakes the spare (a wake of 5 s) and an operator stops the deployment meanwhile.
    With a drain of 30 s, the drain waits for the requests (the waking one holds its slot) and
    the waking one runs on the spare once woken. With a drain of 1 s, the drain ends first: what
    runs is ended (409 deployment_stopped), the closing waits for the wake, and the woken spare
    takes nothing (the closing puts it to rest next): the waking request gets 409 too, not an
    engine stopped under it. Either way every request is answered 200 or 409, and nothing is
    left waking, reserved or owned by the spare."""
    answers: list[tuple[float, int]] = []
    async with one_rests(make_gateway, caplog, config(drain_timeout=drain)) as one:
        one.script(wake_s=5.0)
        lifecycle, life = one.gw.gateway.fleet.lifecycle, one.life

        async def ask(take: float) -> None:
            r = await one.c.post("/v1/chat/completions", json=said(f"take:{take}", "a"))
            answers.append((take, r.status_code))

        async with anyio.create_task_group() as tg:
            await fill(tg, one.ready, ask)
            tg.start_soon(ask, 0.1)
            await eventually(lambda: life.waking is not None)
            await operator_stop(lifecycle, "a", known=True)
    assert len(answers) == 3 and {status for _, status in answers} <= {200, 409}, answers
    if drain == "30s":
        assert (0.1, 200) in answers and spares(caplog)[-1]["chose"] == "wake"
    else:
        assert (0.1, 409) in answers and one.spare.inst.ledger.charged == 0
    assert [lc.state for lc in life.launched] == [InstanceState.STOPPED] * 2
    assert not any(lc.rested for lc in life.launched)  # no spare apart: all rest
    assert life.spare is None and life.waking is None and lifecycle.budget.held() == 0


async def test_a_spare_that_fails_to_wake_leaves_its_request_to_the_ready_one(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """The spare's wake fails: it is stopped (its memory given back), and the request that woke
    it is served by the ready instance."""
    async with one_rests(make_gateway, caplog) as one:
        one.script(wake_fails="out of memory")
        async with anyio.create_task_group() as tg:
            await fill(tg, one.ready, partial(send, one.c))
            await send(one.c, 0.1)
    assert spares(caplog)[-1]["chose"] == "wake"
    assert one.spare.state is InstanceState.FAILED and one.ready.state is InstanceState.READY
    assert one.life.spare is None and one.gw.gateway.fleet.lifecycle.budget.held() == 2 * GiB


async def test_a_spare_that_failed_is_started_again_after_the_crash_backoff(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """A spare whose wake failed stays a spare. With the ready engine full each time: the next
    request starts it again at once (a first failure); that start fails too, so the request
    after it queues within the 1 s backoff and is told so. Once the backoff is over and the
    engine starts, a request starts the spare and runs there (2 s, not 4 s behind the others)."""
    async with one_rests(make_gateway, caplog) as one:
        spare, c = one.spare, one.c
        one.script(wake_fails="out of memory", start_fails="out of memory")
        async with anyio.create_task_group() as tg:
            await fill(tg, one.ready, partial(send, c))
            at = len(spares(caplog))
            for n, failures in enumerate((1, 2, 2), start=at + 1):
                tg.start_soon(send, c, 0.1)
                await eventually(partial(_lines, caplog, n))
                assert spare.crashes == failures and spare.state is InstanceState.FAILED
        one.script()
        assert anyio.current_time() - spare.crashed_at > 1.0  # the fill ran 4 s since
        async with anyio.create_task_group() as tg:
            await fill(tg, one.ready, partial(send, c))
            began = anyio.current_time()
            await send(c, 2)
            took = anyio.current_time() - began
    chose = [(s["chose"], s["why"]) for s in [*spares(caplog)[at : at + 3], spares(caplog)[-1]]]
    woke = ("wake", f"woke instance {spare.inst.index}")
    backoff = ("queue", "the spare failed to come up; next try in 1.0 s")
    assert chose == [woke, woke, backoff, woke], chose
    assert spare.state is InstanceState.READY and not spare.rested
    assert 2.0 <= took <= 2.5, took


def _lines(caplog: pytest.LogCaptureFixture, n: int) -> bool:
    return len(spares(caplog)) == n


def with_b(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with a deployment b of one instance, and a budget that holds a's ready instance,
    its parked spare and b: none left to wake the spare while b is up."""
    b = dict(cfg["deployments"][0], name="b", served_model=served("b"))
    b["instances"] = [{"launch": {"command": [*ENGINE, "--served", served("b")]}}]
    b["lifecycle"] = {}
    cfg["deployments"].append(b)
    cfg["resources"]["memory_budget"] = "4608MiB"
    return cfg


async def test_a_spare_waits_where_the_budget_has_no_room_for_it(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """Once a's spare rested, deployment b took the memory it gave back: a request that would
    wake the spare goes to the ready instance, and nothing is switched out for the spare."""
    async with one_rests(make_gateway, caplog, with_b(config())) as one:
        r = await one.c.post("/v1/chat/completions", json=said("take:0.1", "b"))
        assert r.status_code == 200, r.text
        async with anyio.create_task_group() as tg:
            await fill(tg, one.ready, partial(send, one.c))
            await send(one.c, 0.1)
    assert spares(caplog)[-1]["why"] == "the memory budget has no room for the spare"
    assert one.spare.state is InstanceState.PARKED
    assert sum(one.gw.gateway.fleet.lifecycle.scheduler.switches.values()) == 0


async def test_a_spare_wakes_where_no_ready_instance_takes_requests(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """The ready instance stops taking requests (as when its host's session is lost): a request
    wakes the spare rather than wait for its deadline, and is served by it. Its router line
    says why, with no wait to show."""
    async with one_rests(make_gateway, caplog) as one:
        one.ready.inst.set_open(reachable=False, why="its host's session was lost (the test)")
        await send(one.c, 0.1)
    last = spares(caplog)[-1]
    assert last["chose"] == "wake" and last["wait_s"] is None
    assert last["why"] == f"woke instance {one.spare.inst.index}: no ready one takes requests"
    assert one.spare.state is InstanceState.READY


async def test_a_request_that_no_instance_takes_waits_for_the_spares_backoff_not_its_deadline(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """No ready instance takes requests, and the spare's wake fails, then its start at once: the
    request waits for an instance, but only until the spare's 1 s backoff is over; then it
    decides again, starts the spare (the engine starts now) and is served there, long before
    its 120 s deadline."""
    async with one_rests(make_gateway, caplog) as one:
        spare = one.spare
        one.ready.inst.set_open(reachable=False, why="its host's session was lost (the test)")
        one.script(wake_fails="out of memory", start_fails="out of memory")
        async with anyio.create_task_group() as tg:
            began = anyio.current_time()
            tg.start_soon(send, one.c, 0.1)
            await eventually(lambda: spare.crashes == 2 and one.life.spare is None)
            one.script()
        took = anyio.current_time() - began
    assert spare.state is InstanceState.READY and spare.crashes == 2
    last = spares(caplog)[-1]
    assert last["chose"] == "wake" and last["why"].startswith(f"woke instance {spare.inst.index}")
    assert 1.0 <= took <= 1.5, took


async def test_a_request_that_waited_while_the_spare_parked_wakes_it_once_parked(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """The spare's park takes 2 s, and the ready instance stops taking requests meanwhile: a
    request that finds the spare still parking waits for an instance, and once the park ends
    it decides again and wakes the spare, which serves it (about 2 s, not its 120 s
    deadline)."""
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    gw = await make_gateway(config())
    assert gw.fakes is not None
    gw.fakes.scripts["a"] = Script(park_s=2.0)
    life = gw.gateway.fleet.lifecycle.lives["a"]
    async with gw.client(timeout=300, limits=ONCE) as c:
        async with anyio.create_task_group() as tg:
            tg.start_soon(send, c, 2)
            tg.start_soon(send, c, 2)
        await eventually(lambda: any(lc.state is InstanceState.PARKING for lc in life.launched))
        spare = next(lc for lc in life.launched if lc.rested)
        ready = next(lc for lc in life.launched if not lc.rested)
        ready.inst.set_open(reachable=False, why="its host's session was lost (the test)")
        began = anyio.current_time()
        await send(c, 0.1)
        took = anyio.current_time() - began
    whys = [s["why"] for s in spares(caplog)]
    assert whys[-1] == f"woke instance {spare.inst.index}: no ready one takes requests", whys
    assert spare.state is InstanceState.READY and 1.5 <= took <= 2.5, took


async def test_an_operators_stop_answers_a_request_waiting_for_an_instance_at_once(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """The ready instance stops taking requests and the budget has no room for the spare, so a
    request holds its slot waiting for an instance; an operator stops the deployment: the
    request gets 409 deployment_stopped at once (its drain of 1 s at most), not 503 at its
    120 s deadline."""
    cfg = with_b(config(drain_timeout="1s"))
    answers: list[tuple[int, float]] = []
    async with one_rests(make_gateway, caplog, cfg) as one:
        r = await one.c.post("/v1/chat/completions", json=said("take:0.1", "b"))
        assert r.status_code == 200, r.text
        one.ready.inst.set_open(reachable=False, why="its host's session was lost (the test)")

        async def ask() -> None:
            began = anyio.current_time()
            r = await one.c.post("/v1/chat/completions", json=said("take:0.1", "a"))
            answers.append((r.status_code, anyio.current_time() - began))

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            await eventually(lambda: one.life.route.waiters.waiting == 1)
            await operator_stop(one.gw.gateway.fleet.lifecycle, "a", known=True)
    assert len(answers) == 1 and answers[0][0] == 409 and answers[0][1] <= 1.5, answers
