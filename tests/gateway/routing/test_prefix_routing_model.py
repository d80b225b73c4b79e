"""Prefix routing under a seeded random schedule: many clients at once (four tenants with long
system prompts, two of them under salts, streamed and whole answers, hang-ups before the head
and mid-stream, requests that crash their engine) and operator starts, stops and parks beside
them, over one deployment of two launched instances on the fake runner, with an index small
enough to evict all the time. In one process and with two workers.

Checked at every lifecycle transition: an instance that is not ready holds no fingerprint, and
the index never holds more than its cap. Checked at the end: every request got 200 or a
documented refusal, and only a stop or a crash cut one (the lifecycle model's judge); requests
were routed by prefix; once everything is stopped, nothing is in flight, every cut request
settled and the index is empty.

``CAPYCTL_MODEL_SEED`` and ``CAPYCTL_MODEL_STEPS`` run other schedules, as for the lifecycle
model.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest

from capyctl_gateway._lifecycle import crash
from capyctl_gateway._lifecycle.rest import quiesce
from tests.gateway.conftest import WORKERS, Gw
from tests.gateway.fake_runner import FakeEngines
from tests.gateway.lifecycle.test_lifecycle import launched, management
from tests.gateway.lifecycle.test_lifecycle_model import (
    SEED,
    Ask,
    Command,
    Run,
    ask,
    judge,
    play,
    summary,
)

pytestmark = pytest.mark.anyio
workers = WORKERS
MakeGateway = Callable[..., Awaitable[Gw]]
STEPS = int(os.environ.get("CAPYCTL_MODEL_STEPS", "300"))
PACE = 0.1
CAP = 48
"""The index's entries: a few prompts' worth, so that eviction runs under the traffic."""
TENANTS = {f"t{n}": f"Tenant {n}'s standing instructions, rule {n}. " * 40 for n in range(4)}
SALTS = {"t0": None, "t1": None, "t2": "salt-a", "t3": "salt-b"}


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> FakeEngines:
    for name in ("BACKOFF_FIRST_S", "BACKOFF_MAX_S", "STEADY_S"):
        monkeypatch.setattr(crash, name, getattr(crash, name) * PACE)
    return FakeEngines()


@dataclass
class Turn(Ask):
    tenant: str = "t0"


def schedule(rng: random.Random) -> list[tuple[float, Ask | Command]]:
    steps: list[tuple[float, Ask | Command]] = []
    for _ in range(STEPS):
        gap = rng.uniform(0.0, 0.3) * PACE
        roll = rng.random()
        if roll < 0.82:
            hang = rng.choices([None, "head", "mid"], weights=[6, 1, 1])[0]
            take = rng.choice([0.0, 0.0, 0.3, 1.0]) * PACE
            turn = Turn("p", take, rng.random() < 0.6, hang, tenant=rng.choice(list(TENANTS)))
            steps.append((gap, turn))
        elif roll < 0.85:
            steps.append((gap, Turn("p", 0.0, True, None, crash=True)))
        else:
            steps.append((gap, Command(rng.choice(["start", "stop", "park", "start"]), "p")))
    return steps


async def turn(c: httpx.AsyncClient, a: Turn) -> None:
    """The lifecycle model's request, its tenant's system prompt (and salt) before it."""
    said = "crash" if a.crash else f"take:{a.take}"
    body: dict[str, Any] = {
        "model": "p",
        "messages": [
            {"role": "system", "content": TENANTS[a.tenant]},
            {"role": "user", "content": said},
        ],
    }
    if SALTS[a.tenant] is not None:
        body["cache_salt"] = SALTS[a.tenant]
    await ask(c, a, body)


async def test_prefix_routing_under_a_random_schedule_loses_nothing_and_forgets_what_went(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    print(f"prefix routing model: seed {SEED}, {STEPS} steps")  # noqa: T201
    dep = launched("p", served="p", lifecycle={"drain_timeout": "2s"})
    dep["instances"] = dep["instances"] * 2
    dep["routing"] = {"prefix_entries": CAP, "load_margin": 1}
    gw = await make_gateway({"queue": {"request_deadline": "20s"}, "deployments": [dep]})
    fleet = gw.gateway.fleet
    route = fleet.routes["p"]
    index = route.prefixes
    assert index is not None
    run = Run()

    def check(lc: Any) -> None:
        if lc.state.value != "ready" and index.held(lc.inst.index):
            run.broken.append(f"{lc.inst.where} is {lc.state.value} and still holds prefixes")
        if len(index) > CAP:
            run.broken.append(f"the index holds {len(index)} entries over its cap {CAP}")

    fleet.lifecycle.engines.observers.append(check)
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    runner, base = await management(gw)
    auth = {"Authorization": f"Bearer {gw.key}"}
    rng = random.Random(SEED)
    try:
        await play(gw, base, schedule(rng), run, turn)
        with anyio.fail_after(30):
            await quiesce(fleet.lifecycle.lives["p"])
        print(summary(run))  # noqa: T201
        assert run.broken == []
        judge(run)
        picks = [
            getattr(r, "fields", {}) for r in caplog.records
            if getattr(r, "event", None) == "router_selection"
        ]  # fmt: skip
        assert sum(1 for p in picks if p.get("why") == "prefix") > len(picks) // 3, summary(run)
        async with httpx.AsyncClient(headers=auth, timeout=60) as m:
            assert (await m.post(f"{base}/deployments/p/stop")).status_code == 200
        for inst in route.instances:
            assert inst.ledger.running == 0 and inst.inflight == set()
            assert fleet.settlement.ledgers[inst.key].cut == []
        assert len(index) == 0
    finally:
        await runner.cleanup()
    assert run.broken == []
