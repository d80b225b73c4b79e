"""The Messages API under concurrent traffic on launched engines: many clients at once, chat and
messages mixed, streamed and whole, some hanging up, others counting tokens, with switches under
a memory budget and an operator's commands beside them. Nothing is lost: every answer is a whole
Message (or chat answer) from the model asked, or a documented refusal in its API's shape; a
stream that does not end whole ends with Anthropic's ``error`` event; every slot and every
charge comes back. The engines run on the fake runner (the lifecycle's policy and the relay,
not processes)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import httpx
import pytest

from tests.eventually import eventually
from tests.gateway.anthropic_types import sse_events, validate_error, validate_message
from tests.gateway.conftest import FAKES, VIRTUAL_CLOCK, WORKERS, Gw
from tests.gateway.lifecycle.test_lifecycle import launched, management
from tests.gateway.lifecycle.test_lifecycle_races import served
from tests.gateway.responses.test_responses_races import NAMES, REFUSALS, ROUNDS, _settled

workers = WORKERS
fakes = FAKES
anyio_backend = VIRTUAL_CLOCK  # every engine and client runs in this process

pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]
TYPES = {429: "rate_limit_error", 409: "invalid_request_error", 529: "overloaded_error"}
"""What a Messages refusal may be here, by status: a full queue, an operator's stop, a
deadline or a switch that could not drain in time (the gateway's 503)."""


class Clients:
    """Requests of one kind or another, each judged as it ends; what each came to."""

    def __init__(self, c: httpx.AsyncClient, seed: int) -> None:
        self.c = c
        self.rng = random.Random(seed)
        self.outcomes: list[str] = []

    async def one(self, name: str) -> None:
        kind = self.rng.choice(["messages", "messages-stream", "chat", "hang-up", "count"])
        take = self.rng.choice(["hi", "take:0.3"])
        body: dict[str, Any] = {"model": name, "messages": [{"role": "user", "content": take}]}
        if kind == "chat":
            r = await self.c.post("/v1/chat/completions", json=body)
            self._chat(r, name)
        elif kind == "count":
            r = await self.c.post("/v1/messages/count_tokens", json=body)
            self._judged(r, lambda doc: doc["input_tokens"] > 0)
        elif kind == "messages":
            body["max_tokens"] = 16
            r = await self.c.post("/v1/messages", json=body)
            if r.status_code == 200:
                assert validate_message(r.json()).stop_reason is not None, r.text
            self._judged(r, lambda doc: doc["content"][0]["text"] == f"from {served(name)}")
        else:
            await self._stream(name, take, hang_up=kind == "hang-up")

    async def _stream(self, name: str, take: str, *, hang_up: bool) -> None:
        body = {"model": name, "max_tokens": 16, "stream": True}
        body["messages"] = [{"role": "user", "content": take}]
        async with self.c.stream("POST", "/v1/messages", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                self._judged(r, lambda doc: False)
                return
            text = ""
            async for part in r.aiter_text():
                text += part
                if hang_up and "text_delta" in text:
                    self.outcomes.append("hang-up")
                    return
        events, _ = sse_events(text)
        if events[-1]["type"] == "message_stop":
            said = "".join(e["delta"].get("text", "") for e in events if "delta" in e)
            assert said == f"from {served(name)}", said
            self.outcomes.append("answered")
        else:  # it failed part way, and said so in Anthropic's shape
            assert events[-1]["type"] == "error", text
            self.outcomes.append(f"failed {events[-1]['error']['type']}")

    def _judged(self, r: httpx.Response, right: Callable[[Any], bool]) -> None:
        if r.status_code == 200:
            assert right(r.json()), r.text
            self.outcomes.append("answered")
            return
        error = validate_error(r.json())
        assert TYPES.get(r.status_code) == error.error.type, r.text
        self.outcomes.append(f"refused {error.error.message.split(':')[0]}")

    def _chat(self, r: httpx.Response, name: str) -> None:
        if r.status_code == 200:
            assert r.json()["choices"][0]["message"]["content"] == f"from {served(name)}"
            self.outcomes.append("answered")
            return
        assert (r.status_code, r.json()["code"]) in REFUSALS, r.text
        self.outcomes.append(f"refused {r.json()['code']}")


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


async def test_a_message_for_a_parked_model_wakes_it_and_a_stopped_one_is_refused(
    make_gateway: MakeGateway,
) -> None:
    """The lifecycle is chat's: parked, the next Message starts the model again and is
    answered; stopped by the operator, it is refused in Anthropic's shape (409), not woken."""
    name = "a"
    gw = await make_gateway({"deployments": [launched(name, served=served(name))]})
    runner, base = await management(gw)
    auth = {"Authorization": f"Bearer {gw.key}"}
    body = {"model": name, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with gw.client() as c, httpx.AsyncClient(headers=auth, timeout=60) as m:
            assert (await c.post("/v1/messages", json=body)).status_code == 200
            parked = await m.post(f"{base}/deployments/{name}/park")
            assert parked.json()["deployment"]["state"] == "standby"
            woken = await c.post("/v1/messages", json=body)
            assert woken.status_code == 200, woken.text
            assert validate_message(woken.json()).content[0].type == "text"
            after = (await m.get(f"{base}/deployments/{name}")).json()["deployment"]
            assert after["lifecycle"] == "ready"
            assert (await m.post(f"{base}/deployments/{name}/stop")).status_code == 200
            refused = await c.post("/v1/messages", json=body)
    finally:
        await runner.cleanup()
    assert refused.status_code == 409
    error = validate_error(refused.json()).error
    assert error.type == "invalid_request_error"
    assert error.message.startswith("deployment_stopped: ")
