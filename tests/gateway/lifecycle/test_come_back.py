"""Deployments marked to come back (``lifecycle.come_back``): switched out for another under the
memory budget, one starts again by itself once the budget has room, never switching another
out for that; one not marked, or stopped by an operator, stays down. On the fake runner, with
one process and with two workers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from capyctl_gateway._lifecycle.comeback import COME_BACK_REASON
from tests.eventually import eventually
from tests.gateway.conftest import FAKES, VIRTUAL_CLOCK, WORKERS, Gw
from tests.gateway.lifecycle.test_lifecycle import chat, launched, management, refused, transitions
from tests.gateway.lifecycle.test_lifecycle_races import served

workers = WORKERS
fakes = FAKES
anyio_backend = VIRTUAL_CLOCK  # every engine and client runs in this process

pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]
MEMORY = {"ready": "1GiB"}


async def test_a_marked_deployment_comes_back_once_the_budget_has_room(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """Budget for one. a (marked) is switched out for b, b for c; c stops: a comes back by
    itself, b (not marked) does not; the budget is never overrun. Stopped by an operator, a
    no longer comes back."""
    marked = {"come_back": True}
    deps = [
        launched("a", served=served("a"), memory=MEMORY, lifecycle=marked),
        launched("b", served=served("b"), memory=MEMORY),
        launched("c", served=served("c"), memory=MEMORY),
    ]
    gw = await make_gateway({"resources": {"memory_budget": "1GiB"}, "deployments": deps})
    assert gw.fakes is not None
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    lifecycle = gw.gateway.fleet.lifecycle
    held: list[int] = []  # what the budget holds after each transition
    lifecycle.engines.observers.append(lambda lc: held.append(lifecycle.budget.held()))
    runner, base = await management(gw)
    auth = {"Authorization": f"Bearer {gw.key}"}
    try:
        async with gw.client(timeout=60) as c, httpx.AsyncClient(headers=auth, timeout=60) as m:
            for name in ("a", "b", "c"):  # each switches the one before out
                assert (await c.post("/v1/chat/completions", json=chat(name))).status_code == 200
            assert lifecycle.lives["a"].displaced and lifecycle.lives["b"].displaced
            starts = gw.fakes.starts["a/0"]
            assert (await m.post(f"{base}/deployments/c/stop")).status_code == 200
            await eventually(lambda: lifecycle.lives["a"].ready)
            assert gw.fakes.starts["a/0"] == starts + 1
            back = [t for t in transitions(caplog, "starting") if t["deployment"] == "a"]
            assert back[-1]["reason"] == COME_BACK_REASON
            assert not lifecycle.lives["b"].ready and gw.fakes.running(served("b")) == []
            assert max(held) <= 2**30  # the budget, never more
            # Marked, but stopped by an operator: it stays down.
            assert (await m.post(f"{base}/deployments/c/start")).status_code == 200
            assert (await c.post("/v1/chat/completions", json=chat("c"))).status_code == 200
            assert lifecycle.lives["a"].displaced
            assert (await m.post(f"{base}/deployments/a/stop")).status_code == 200
            # The stop answers once its closing is over, whose end schedules the look: a few
            # turns of the loop later, the look has been.
            assert (await m.post(f"{base}/deployments/c/stop")).status_code == 200
            for _ in range(5):
                await asyncio.sleep(0)
            assert not lifecycle.lives["a"].ready and not lifecycle.lives["a"].activating
            assert gw.fakes.starts["a/0"] == starts + 1  # not started again
    finally:
        await runner.cleanup()


def test_come_back_that_would_do_nothing_is_refused(tmp_path: Path) -> None:
    no_budget = refused(tmp_path, {"deployments": [launched(lifecycle={"come_back": True})]})
    assert "lifecycle.come_back would do nothing: there is no resources.memory_budget" in no_budget
    kept = refused(
        tmp_path,
        {
            "resources": {"memory_budget": "2GiB"},
            "deployments": [
                launched(memory=MEMORY, lifecycle={"come_back": True, "activation": "always"})
            ],
        },
    )
    assert "it is kept ready" in kept
