"""Decision requests on POST /v1/systemone, against a fake decision engine on a real socket."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import orjson
import pytest

from capyctl_gateway._deployments.settle import SettleRule
from tests.gateway.conftest import WORKERS, Gw, deployments
from tests.gateway.fake_engine import FakeEngine, Hold, Reply

workers = WORKERS


pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]
ASK: dict[str, Any] = {
    "model": "decider",
    "state": "I was charged twice for my order last week.",
    "questions": {
        "route": {
            "type": "choice",
            "instructions": "Which team should handle this?",
            "criteria": {"billing": "payments and refunds", "shipping": None, "technical": None},
        },
        "angry": {"type": "noul", "instructions": "Is the customer angry?"},
        "urgency": {
            "type": "score",
            "instructions": "How urgent is this?",
            "criteria": ["can wait", "this week", "today"],
        },
    },
}


async def decide(gw: Gw, body: dict[str, Any], **headers: str) -> Any:
    async with gw.client() as c:
        return await c.post("/v1/systemone", json=body, headers=headers)


async def test_a_decision_is_answered_with_the_public_name_usage_and_figures(
    gateway: Gw, engine: FakeEngine
) -> None:
    r = await decide(gateway, ASK, **{"X-Request-Id": "order-7"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "order-7" and len(r.headers["x-capyctl-request-id"]) == 26
    answer = r.json()
    assert answer["model"] == "decider"
    assert set(answer["answers"]) == {"route", "angry", "urgency"}
    assert answer["usage"] == {"input_tokens": 87, "output_tokens": 0}
    figures = answer["capyctl"]["metrics"]
    assert set(figures) == {"input_tokens", "time_to_response_ms", "total_ms"}
    assert figures["input_tokens"] == {"value": 87, "source": "engine"}
    assert figures["total_ms"]["source"] == "router"
    assert figures["total_ms"]["value"] >= figures["time_to_response_ms"]["value"] >= 0
    (got,) = engine.received
    assert got.body == {**ASK, "model": "tiny"}  # the engine's own name, nothing added
    assert "x-request-id" not in {k.lower() for k in got.headers}


async def test_engine_figures_are_read_when_reported(gateway: Gw, engine: FakeEngine) -> None:
    reply = {
        "answers": {},
        "model": "tiny",
        "usage": {
            "input_tokens": 10,
            "output_tokens": 0,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
        "tensorfold": {"prefill_seconds": 0.0125},
    }
    engine.decision = Reply(200, orjson.dumps(reply))
    figures = (await decide(gateway, ASK)).json()["capyctl"]["metrics"]
    assert figures["cached_tokens"] == {"value": 8, "source": "engine"}
    assert figures["prefill_ms"] == {"value": 12.5, "source": "engine"}
    assert "ttft_ms" not in figures and "decode_tokens_per_second" not in figures
    assert "queue_ms" not in figures  # not reported: left out


@pytest.mark.parametrize(
    ("change", "status", "code", "says"),
    [
        ({"stream": False}, 400, "invalid_request", "`stream`"),
        ({"temperature": 0.1}, 400, "invalid_request", "`temperature`"),
        ({"return_hidden_states": True}, 400, "invalid_request", "`return_hidden_states`"),
        ({"images": "data:image/png;base64,AAAA"}, 400, "invalid_request", "images"),
        ({"files": [1]}, 400, "invalid_request", "files"),
        ({"model": "nope"}, 404, "unknown_model", "nope"),
        ({"model": 3}, 400, "invalid_request", "model"),
        ({"model": "my-model"}, 400, "api_mismatch", "POST /v1/chat/completions"),
    ],
)
async def test_refusals_reach_no_engine(
    gateway: Gw, engine: FakeEngine, change: dict[str, Any], status: int, code: str, says: str
) -> None:
    r = await decide(gateway, {**ASK, **change})
    assert (r.status_code, r.json()["code"]) == (status, code)
    assert says in r.json()["message"]
    assert "x-capyctl-request-id" in r.headers
    assert engine.received == []


async def test_a_decision_model_does_not_answer_chat(gateway: Gw, engine: FakeEngine) -> None:
    async with gateway.client() as c:
        r = await c.post("/v1/chat/completions", json={"model": "decider", "messages": []})
    assert (r.status_code, r.json()["code"]) == (400, "api_mismatch")
    assert r.json()["message"] == (
        "model decider serves the decisions API, which /v1/chat/completions does not answer; "
        "send its requests to POST /v1/systemone"
    )
    assert engine.received == []


@pytest.mark.parametrize("status", [400, 413, 422])
async def test_engine_refusals_come_back_as_engine_rejected(
    gateway: Gw, engine: FakeEngine, status: int
) -> None:
    engine.decision = Reply(status, orjson.dumps({"error": {"message": "too many questions"}}))
    r = await decide(gateway, ASK)
    assert r.status_code == status
    assert r.json() == {"code": "engine_rejected", "message": "too many questions"}


@pytest.mark.parametrize("reply", [Reply(500, b"{}"), Reply(200, b"not json", "text/plain")])
async def test_other_engine_failures_are_502(gateway: Gw, engine: FakeEngine, reply: Reply) -> None:
    engine.decision = reply
    r = await decide(gateway, ASK)
    assert (r.status_code, r.json()["code"]) == (502, "engine_error")


async def test_the_body_limit_is_configurable(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway(
        {
            "limits": {"max_decision_body_bytes": 2048},
            "deployments": [
                deployments(
                    engine.url,
                    name="decider",
                    api="decisions",
                    engine="tensorfold",
                    engine_version="0.6.1",
                )
            ],
        }
    )
    r = await decide(gw, {**ASK, "images": ["data:image/png;base64," + "A" * 4096]})
    assert (r.status_code, r.json()["code"]) == (413, "request_too_large")
    assert engine.received == []
    assert (await decide(gw, ASK)).status_code == 200


async def test_a_hang_up_closes_the_engine_connection_and_waits_for_a_restart(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.decision = Hold()
    async with gateway.client() as c, anyio.create_task_group() as tg:
        tg.start_soon(partial(c.post, "/v1/systemone", json=ASK))
        with anyio.fail_after(5):
            await engine.arrived.wait()
        tg.cancel_scope.cancel()
    with anyio.fail_after(5):
        await engine.hung_up.wait()
    book = gateway.gateway.fleet.settlement.ledgers["decider/0"]
    assert [(c.rule, c.reason) for c in book.cut] == [(SettleRule.AT_RESTART, "hang_up")]


async def test_an_engines_refusal_counts_as_refused_on_decisions_as_on_chat(
    gateway: Gw, engine: FakeEngine
) -> None:
    """Regression: the decision relay raised the engine's 400 outside its exchange, so the
    gateway's own metrics counted it engine_error while chat counted the same 400 refused."""
    from tests.gateway.management.test_metrics import samples, scrape

    refusal = Reply(400, orjson.dumps({"error": {"message": "too many questions"}}))
    engine.decision = engine.script = refusal
    assert (await decide(gateway, ASK)).status_code == 400
    async with gateway.client() as c:
        chat = {"model": "my-model", "messages": [{"role": "user", "content": "x"}]}
        assert (await c.post("/v1/chat/completions", json=chat)).status_code == 400
    got = samples((await scrape(gateway)).text)

    def count(deployment: str, api: str, outcome: str) -> float:
        labels = (("api", api), ("deployment", deployment), ("outcome", outcome))
        return got.get(("capyctl_requests_total", labels), 0.0)

    assert count("decider", "decisions", "refused") == 1
    assert count("decider", "decisions", "engine_error") == 0
    assert count("my-model", "chat", "refused") == 1
    assert count("decider", "decisions", "refused") == count("my-model", "chat", "refused")
