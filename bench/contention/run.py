"""One run of the contention benchmark: a fresh gateway for one policy, one scenario and one
engine; each deployment brought in once (the warm-up: its first start measured, as a running
gateway would have), then the scenario's window, with the gateway's metrics read before and
after and its deployments list read every ``LIST_EVERY_S`` during it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import httpx

from bench.perf._procs import ProcessSet

from .engines import Engine
from .gateway import Gateway, Listed, start
from .load import Ask
from .report import figures
from .scenarios import Scenario, Timing

__all__ = ["one"]

LIST_EVERY_S = 0.5
TAIL_S = 120.0
"""How long what was sent in the window may take to be answered after it; past that, it is
cut off and counted lost."""


async def _read_list(gw: Gateway, c: httpx.AsyncClient, listed: Listed) -> None:
    while True:
        with contextlib.suppress(httpx.HTTPError):
            listed.add(await gw.listing(c))
        await asyncio.sleep(LIST_EVERY_S)  # the reader's own pace


async def _measure(
    gw: Gateway, engine: Engine, scenario: Scenario, timing: Timing, served: dict[str, str]
) -> dict[str, Any]:
    timeout = httpx.Timeout(TAIL_S + 600, connect=10)
    # An idle connection is given up before the gateway closes it (its keepalive_timeout, 5 s),
    # so that no request is sent on a connection the gateway is closing at that moment.
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64, keepalive_expiry=2)
    async with httpx.AsyncClient(headers=gw.headers, timeout=timeout, limits=limits) as c:
        ask = Ask(
            c,
            f"{gw.url}/v1/chat/completions",
            body=engine.body,
            whole=lambda text, name: engine.answered(text, served[name]),
        )
        warm = time.monotonic()
        for name in scenario.names:  # each in once, one after the other
            if not await ask(name):
                raise RuntimeError(f"the warm-up request for {name} failed: {ask.sent[-1]}")
        warm = time.monotonic() - warm
        before = await asyncio.to_thread(gw.metrics)
        listed = Listed()
        reader = asyncio.create_task(_read_list(gw, c, listed))
        ask.restart()
        window = scenario.window(timing)
        with contextlib.suppress(TimeoutError):  # what is still unanswered is lost
            await asyncio.wait_for(scenario.drive(ask, timing), timeout=window + TAIL_S)
        elapsed = ask.now()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        after = await asyncio.to_thread(gw.metrics)
    run = figures(
        ask.sent, ask.started, elapsed, before, after, listed, scenario.names, scenario.fits
    )
    return run | {"warmup_s": round(warm, 1)}


def one(
    procs: ProcessSet,
    work: Path,
    engine: Engine,
    policy: str,
    scenario: Scenario,
    timing: Timing,
    tag: str,
) -> dict[str, Any]:
    """The figures of one run (``tag`` makes its engines' served names unique to it)."""
    served = {name: f"{name}-{tag}" for name in scenario.names}
    config = {
        "resources": {"memory_budget": f"{scenario.fits}GiB", "switching": policy},
        "queue": {"request_deadline": "600s", "max_waiting_per_deployment": 1024},
        "deployments": [engine.deployment(n, served[n], "1GiB") for n in scenario.names],
    }
    name = f"gateway-{engine.key}-{scenario.key}-{policy}"
    began = time.monotonic()
    gw = start(procs, work / name, config, name)
    started = time.monotonic()
    try:
        run = asyncio.run(_measure(gw, engine, scenario, timing, served))
    finally:
        stopping = time.monotonic()
        procs.stop(gw.proc, timeout_s=30)
        procs.procs.remove(gw.proc)
    run["start_s"] = round(started - began, 1)
    run["stop_s"] = round(time.monotonic() - stopping, 1)
    run = {"engine": engine.key, "scenario": scenario.key, "policy": policy, **run}
    run["gateway_pid"] = gw.proc.pid
    run["run_s"] = round(time.monotonic() - began, 1)
    return run
