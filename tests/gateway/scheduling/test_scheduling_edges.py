"""The scheduler at its edges, on the fake runner and the virtual clock (``test_scheduling.py``
has its policy): two switches whose rooms do not fit the budget together both go through (they
once waited for each other for good); a drain is measured only where requests ran; and a start
whose requests have all left switches nothing out."""

from __future__ import annotations

import anyio
import pytest

from capyctl_gateway._lifecycle.operator import operator_park
from tests.eventually import eventually
from tests.gateway.conftest import FAKES, VIRTUAL_CLOCK, WORKERS
from tests.gateway.fake_runner import Script
from tests.gateway.lifecycle.test_lifecycle import launched
from tests.gateway.lifecycle.test_lifecycle_races import said, served
from tests.gateway.scheduling.test_scheduling import GiB, MakeGateway, config, send, stream

pytestmark = pytest.mark.anyio
workers = WORKERS
fakes = FAKES
anyio_backend = VIRTUAL_CLOCK


@pytest.mark.parametrize("switching", ["on_arrival", "cost_aware"])
async def test_two_switches_whose_rooms_do_not_fit_together_both_go_through(
    make_gateway: MakeGateway, switching: str
) -> None:
    """x and y (2 GiB each) fill a 4 GiB budget, idle; b and d (3 GiB each, d first by its
    priority) ask 0.3 s apart while x and y each take 1 s to stop. Each switch's room is kept
    for the deployment it was made for, and the room for both does not fit: the second waits
    for the first's activation rather than being promised room that is not there (both then
    waited for each other for good, every request for either 503 at its deadline until the
    gateway restarted). Both are served, within the budget, and no room stays kept."""
    deps = [
        launched(n, served=served(n), memory={"ready": mem}, extra=["--slow-start", "2"])
        for n, mem in (("x", "2GiB"), ("y", "2GiB"), ("b", "3GiB"), ("d", "3GiB"))
    ]
    deps[3]["lifecycle"] = {"priority": -1}
    cfg = {
        "resources": {"memory_budget": "4GiB", "switching": switching},
        "queue": {"request_deadline": "60s"},
        "deployments": deps,
    }
    gw = await make_gateway(cfg)
    assert gw.fakes is not None
    gw.fakes.scripts.update(x=Script(stop_s=1.0), y=Script(stop_s=1.0))
    lifecycle = gw.gateway.fleet.lifecycle
    held: list[int] = []
    lifecycle.engines.observers.append(lambda lc: held.append(lifecycle.budget.held()))
    async with gw.client(timeout=300) as c:
        for n in ("x", "y"):
            await send(c, n, 0.1)
        await anyio.sleep(10)  # both quiet past any grace
        async with anyio.create_task_group() as tg:
            tg.start_soon(send, c, "b", 0.1)
            await anyio.sleep(0.3)
            tg.start_soon(send, c, "d", 0.1)
        await send(c, "b", 0.1)  # and the next one too
    assert max(held) <= 4 * GiB, held
    assert lifecycle.budget.promised("this machine") == []
    assert not any(life.activating for life in lifecycle.lives.values())


async def test_a_drain_is_measured_only_where_requests_ran(make_gateway: MakeGateway) -> None:
    """a is parked while a 2 s generation runs: its drain is measured (2 s). Parked again when
    idle, nothing was drained: the 2 s stay what a's next switch out while busy is priced by
    (an idle closing wrote 0 s over it)."""
    gw = await make_gateway(config("a"))
    lifecycle = gw.gateway.fleet.lifecycle
    costs = lifecycle.scheduler.costs
    async with gw.client(timeout=300) as c:
        await send(c, "a", 0.1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(send, c, "a", 2)
            await eventually(lambda: lifecycle.lives["a"].route.queue.running == 1)
            await operator_park(lifecycle, "a", known=True)
        assert 2.0 - 0.2 <= costs.last[("a", "drain")] <= 2.0 + 0.1, costs.last
        await send(c, "a", 0.1)  # woken
        await operator_park(lifecycle, "a", known=True)
    assert 2.0 - 0.2 <= costs.last[("a", "drain")] <= 2.0 + 0.1, costs.last


async def test_a_start_whose_requests_all_left_switches_nothing_out(
    make_gateway: MakeGateway,
) -> None:
    """a's stream keeps it busy; b's one request waits for room (the fairness bound, 5 s) and
    hangs up after 1 s. With nobody left waiting for b, its start ends: a is not switched out
    (before, at the bound the start went on as if an operator had asked, drained a and parked
    it for nobody), and every one of a's requests is served without a start. b's next request
    asks again, and is served."""
    gw = await make_gateway(config("a", "b", max_switch_wait="5s", switch_patience=100))
    assert gw.fakes is not None
    lifecycle = gw.gateway.fleet.lifecycle
    async with gw.client(timeout=300) as c:
        await send(c, "a", 0.1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stream, tg, c, "a", 24)
            await anyio.sleep(1)
            with anyio.move_on_after(1) as hung:
                await c.post("/v1/chat/completions", json=said("take:0.1", "b"))
            assert hung.cancelled_caught
            await eventually(lambda: not lifecycle.lives["b"].activating)
            assert lifecycle.lives["b"].route.queue.waiting == 0
        assert sum(lifecycle.scheduler.switches.values()) == 0
        assert dict(gw.fakes.starts) == {"a/0": 1}
        await send(c, "b", 0.1)  # asks again: a is idle now, and goes
    assert dict(gw.fakes.starts) == {"a/0": 1, "b/0": 1}
    assert not any(life.activating for life in lifecycle.lives.values())
