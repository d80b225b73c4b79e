"""The Responses API under concurrent traffic on launched engines: many clients at once, chat
and responses mixed, streamed and whole, some hanging up, with switches under a memory budget
and an operator's commands beside them. Nothing is lost: every answer is a whole Response (or
chat answer) from the model asked, or a documented refusal; a stream that does not end whole
ends with ``response.failed``; every slot and every charge comes back. The engines run on the
fake runner (these are the lifecycle's policy and the relay, not processes)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import httpx
import orjson
import pytest

from capyctl_gateway._deployments.routes import Route
from tests.eventually import eventually
from tests.gateway.conftest import FAKES, VIRTUAL_CLOCK, WORKERS, Gw
from tests.gateway.lifecycle.test_lifecycle import launched, management
from tests.gateway.lifecycle.test_lifecycle_races import served
from tests.gateway.openai_schemas import validate_event, validate_response

workers = WORKERS
fakes = FAKES
anyio_backend = VIRTUAL_CLOCK  # every engine and client runs in this process

pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]
NAMES = ("a", "b")
ROUNDS = 6
REFUSALS = {(409, "deployment_stopped"), (503, "unavailable"), (429, "queue_full")}
"""What a request may be refused with here: an operator's stop, a deadline or a switch that
could not drain in time, a full queue."""


def _events(text: str) -> list[dict[str, Any]]:
    out = []
    for block in text.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                ev = orjson.loads(line[6:])
                validate_event(ev)
                out.append(ev)
    return out


class Clients:
    """Requests of one kind or another, each judged as it ends; what each came to."""

    def __init__(self, c: httpx.AsyncClient, seed: int) -> None:
        self.c = c
        self.rng = random.Random(seed)
        self.outcomes: list[str] = []

    async def one(self, name: str) -> None:
        kind = self.rng.choice(["responses", "responses-stream", "chat", "hang-up"])
        take = self.rng.choice(["hi", "take:0.3"])
        if kind == "chat":
            body = {"model": name, "messages": [{"role": "user", "content": take}]}
            r = await self.c.post("/v1/chat/completions", json=body)
            self._judged(r, lambda doc: doc["choices"][0]["message"]["content"], name)
        elif kind == "responses":
            r = await self.c.post("/v1/responses", json={"model": name, "input": take})
            if r.status_code == 200:
                validate_response(r.json())
                assert r.json()["status"] == "completed", r.text
            self._judged(r, lambda doc: doc["output"][0]["content"][0]["text"], name)
        else:
            await self._stream(name, take, hang_up=kind == "hang-up")

    async def _stream(self, name: str, take: str, *, hang_up: bool) -> None:
        body = {"model": name, "input": take, "stream": True}
        async with self.c.stream("POST", "/v1/responses", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                self._judged(r, lambda doc: "", name)
                return
            text = ""
            async for part in r.aiter_text():
                text += part
                if hang_up and "response.output_text.delta" in text:
                    self.outcomes.append("hang-up")
                    return
        events = _events(text)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        last = events[-1]
        if last["type"] == "response.completed":
            said = last["response"]["output"][0]["content"][0]["text"]
            assert said == f"from {served(name)}", said
            self.outcomes.append("answered")
        else:  # it failed part way, and said so with our code first
            assert last["type"] == "response.failed" and events[-2]["type"] == "error", text
            self.outcomes.append(f"failed {events[-2]['code']}")

    def _judged(self, r: httpx.Response, said: Callable[[Any], str], name: str) -> None:
        if r.status_code == 200:
            assert said(r.json()) == f"from {served(name)}", r.text
            self.outcomes.append("answered")
            return
        code = r.json()["code"]
        assert (r.status_code, code) in REFUSALS, r.text
        self.outcomes.append(f"refused {code}")


async def test_mixed_traffic_with_switches_hang_ups_and_an_operator_loses_nothing(
    make_gateway: MakeGateway,
) -> None:
    memory, cycle = {"ready": "1GiB"}, {"drain_timeout": "5s"}
    deps = [launched(n, served=served(n), memory=memory, lifecycle=cycle) for n in NAMES]
    gw = await make_gateway(
        {
            "resources": {"memory_budget": "1GiB"},
            "queue": {"request_deadline": "20s"},
            "deployments": deps,
        }
    )
    runner, base = await management(gw)
    auth = {"Authorization": f"Bearer {gw.key}"}
    operator: list[int] = []
    try:
        async with gw.client(timeout=60) as c, httpx.AsyncClient(headers=auth, timeout=60) as m:
            clients = [Clients(c, seed) for seed in range(8)]

            async def run(client: Clients, name: str) -> None:
                for _ in range(ROUNDS):
                    await client.one(name)

            async def operate() -> None:
                # Once traffic flows on both, the operator parks, stops and starts b.
                await eventually(lambda: sum(x.outcomes.count("answered") for x in clients) >= 8)
                for action in ("park", "start", "stop", "start"):
                    r = await m.post(f"{base}/deployments/b/{action}")
                    operator.append(r.status_code)
                    await anyio.sleep(0.3)  # the operator's pace, not a wait for anything

            async with anyio.create_task_group() as tg:
                for i, client in enumerate(clients):
                    tg.start_soon(run, client, NAMES[i % 2])
                tg.start_soon(operate)
    finally:
        await runner.cleanup()
    outcomes = [o for client in clients for o in client.outcomes]
    assert len(outcomes) == len(clients) * ROUNDS
    on_a = [o for i, client in enumerate(clients) if i % 2 == 0 for o in client.outcomes]
    assert "refused deployment_stopped" not in on_a  # the operator never touched a
    assert outcomes.count("answered") >= len(outcomes) // 2, Counter(outcomes)
    assert set(operator) <= {200, 409}, operator
    for name in NAMES:
        await eventually(partial(_settled, gw.gateway.fleet.routes[name]))


def _settled(route: Route) -> bool:
    """No slot taken or waited for, no request charged or in flight on any instance."""
    queue = route.queue
    free = queue.running == 0 and queue.waiting == 0
    return free and all(i.ledger.charged == 0 and not i.inflight for i in route.instances)
