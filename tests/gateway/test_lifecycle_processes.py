"""One engine process to show and one to stop, whoever kills which; engines that exit unasked
are seen at once and restarted, with a growing delay when they keep crashing. Real processes
(the launchable fake engine under the gateway's reaper)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from capyctl_gateway._management.status import deployment_status
from tests.gateway.conftest import Gw
from tests.gateway.test_lifecycle import chat, launched, wait_gone
from tests.gateway.test_lifecycle_races import engines_running, said, served

pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]


def process(gw: Gw, name: str = "my-model") -> dict[str, Any]:
    doc = deployment_status(gw.gateway.fleet, name)
    assert doc is not None
    return dict(doc["instances"][0]["process"])


def moved_to(gw: Gw, state: str) -> asyncio.Event:
    seen = asyncio.Event()
    gw.gateway.fleet.lifecycle.engines.observers.append(
        lambda lc: seen.set() if lc.state.value == state else None
    )
    return seen


@pytest.mark.parametrize("whom", ["engine", "reaper"])
async def test_killing_either_pid_status_shows_leaves_no_engine_and_no_second_one(
    make_gateway: MakeGateway, whom: str
) -> None:
    """``status`` showed the reaper's pid; killing it orphaned the engine, and the gateway
    started a second engine for the instance while the first ran on."""
    name = served("solo")
    gw = await make_gateway({"deployments": [launched(served=name)]})
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        shown = process(gw)
        assert engines_running(name) == [shown["pid"]]  # the engine's own pid
        assert shown["reaper_pid"] != shown["pid"]
        failed = moved_to(gw, "failed")
        os.kill(shown["pid"] if whom == "engine" else shown["reaper_pid"], signal.SIGKILL)
        with anyio.fail_after(10):
            await failed.wait()
        await anyio.to_thread.run_sync(wait_gone, shown["pid"])
        await anyio.to_thread.run_sync(wait_gone, shown["reaper_pid"])
        assert engines_running(name) == []
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
        again = process(gw)
        assert engines_running(name) == [again["pid"]] and again["pid"] != shown["pid"]


@pytest.mark.parametrize("whom", ["stop", "reaper"])
async def test_a_child_that_left_the_engines_group_dies_with_the_engine(
    make_gateway: MakeGateway, tmp_path: Path, whom: str
) -> None:
    """A child that left the engine's process group (``setsid``) outlived every stop."""
    stray_file = tmp_path / "stray.pid"
    gw = await make_gateway(
        {"deployments": [launched(extra=["--stray-pid-file", str(stray_file)])]}
    )
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    stray = int(stray_file.read_text())
    assert os.getsid(stray) == stray  # it really left
    shown = process(gw)
    if whom == "stop":
        life = gw.gateway.fleet.lifecycle.lives["my-model"]
        await gw.gateway.fleet.lifecycle.close(life, "a test's stop", may_park=False, must=True)
    else:  # the engine is killed first: its stray is then the reaper's to collect
        os.kill(shown["pid"], signal.SIGKILL)
    await anyio.to_thread.run_sync(wait_gone, stray)
    await anyio.to_thread.run_sync(wait_gone, shown["reaper_pid"])


async def test_an_engine_that_keeps_crashing_is_restarted_later_each_time(
    make_gateway: MakeGateway,
) -> None:
    """A crash loop had no backoff: 31 starts for 30 requests."""
    gw = await make_gateway({"deployments": [launched()], "queue": {"request_deadline": "60s"}})
    starts: list[str] = []
    gw.gateway.fleet.lifecycle.engines.observers.append(
        lambda lc: starts.append(lc.state.value) if lc.state.value == "starting" else None
    )
    backoffs: list[float] = []
    async with gw.client(timeout=90) as c:
        for _ in range(3):
            failed = moved_to(gw, "failed")
            r = await c.post("/v1/chat/completions", json={**said("crash", "my-model")})
            assert r.status_code in (200, 502), r.text  # cut: in band, or before the head
            with anyio.fail_after(10):
                await failed.wait()
            doc = deployment_status(gw.gateway.fleet, "my-model")
            assert doc is not None
            backoffs.append(doc["instances"][0].get("restart_backoff_s", 0.0))
        assert doc is not None and doc["instances"][0]["failures_in_a_row"] == 3
        ok = await c.post("/v1/chat/completions", json=chat())  # waits out the backoff
        assert ok.status_code == 200, ok.text
    assert backoffs[0] == 0.0 and 0 < backoffs[1] < backoffs[2]  # 1 s, then 2 s
    assert len(starts) == 4


async def test_an_engine_that_stops_answering_is_replaced(make_gateway: MakeGateway) -> None:
    """An engine stopped with SIGSTOP stayed ready for ever; every request waited out its
    deadline."""
    dep = launched(lifecycle={"unresponsive_timeout": "1s"})
    gw = await make_gateway({"deployments": [dep]})
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        frozen = process(gw)["pid"]
        failed = moved_to(gw, "failed")
        os.kill(frozen, signal.SIGSTOP)
        try:
            with anyio.fail_after(30):
                await failed.wait()
            await anyio.to_thread.run_sync(wait_gone, frozen)  # killed, not left stopped
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGKILL)
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
        assert process(gw)["pid"] != frozen
