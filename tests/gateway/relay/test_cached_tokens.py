"""A deployment that withholds ``cached_tokens`` from its clients (issue 42, item 16).

Without a ``cache_salt``, the count of cached prompt tokens a client gets back tells it whether
another client's prompt is in the engine's cache. With ``cached_tokens: withheld`` no answer
carries the count, in any form an engine or the gateway gives it: ``usage``'s, llama.cpp's
``timings`` (``cache_n``, and ``prompt_n`` beside the prompt's tokens), the gateway's own
``cached_tokens`` figure, a Response's usage; on chat, Responses and decisions, whole and
streamed. By default it is shown, as before.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from tests.gateway.conftest import Gw, deployments
from tests.gateway.fake_engine import DONE, FakeEngine, Reply, chunk, event, vllm_stream

pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]
USAGE = {
    "prompt_tokens": 800,
    "completion_tokens": 3,
    "total_tokens": 803,
    "prompt_tokens_details": {"cached_tokens": 768},
}
TIMINGS = {"cache_n": 768, "prompt_n": 32, "prompt_ms": 0.9, "predicted_per_second": 40.0}


@pytest.fixture
async def withheld(engine: FakeEngine, make_gateway: MakeGateway) -> Gw:
    """A vLLM chat deployment, a llama.cpp one and a decisions one, all withholding it."""
    over = {"cached_tokens": "withheld"}
    return await make_gateway(
        {
            "deployments": [
                deployments(engine.url, **over),
                deployments(
                    engine.url, name="llama", engine="llamacpp", engine_version="b10798", **over
                ),
                deployments(
                    engine.url,
                    name="decider",
                    api="decisions",
                    engine="tensorfold",
                    engine_version="0.6.1",
                    **over,
                ),
            ]
        }
    )


def llama_stream() -> list[Any]:
    """llama-server's end: its timings on the finish chunk, then usage, then [DONE]."""
    return [
        event(chunk(delta={"role": "assistant", "content": ""})),
        event(chunk(delta={"content": "Hi"})),
        event(chunk(delta={}, finish="stop", timings=TIMINGS)),
        event(chunk(choices=[], usage=USAGE, timings=TIMINGS)),
        DONE,
    ]


ASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": "my-model", "messages": []}),
    "chat stream": ("/v1/chat/completions", {"model": "my-model", "messages": [], "stream": True}),
    "llama": ("/v1/chat/completions", {"model": "llama", "messages": []}),
    "llama stream": ("/v1/chat/completions", {"model": "llama", "messages": [], "stream": True}),
    "responses": ("/v1/responses", {"model": "my-model", "input": "x"}),
    "responses stream": ("/v1/responses", {"model": "my-model", "input": "x", "stream": True}),
    "decisions": ("/v1/systemone", {"model": "decider", "state": "s", "questions": {}}),
}


@pytest.mark.parametrize("ask", sorted(ASKS))
async def test_a_deployment_that_withholds_cached_tokens_tells_no_client_of_them(
    withheld: Gw, engine: FakeEngine, ask: str
) -> None:
    engine.script = llama_stream() if ask.startswith("llama") else vllm_stream(usage=USAGE)
    answer = {"answers": {}, "model": "tiny", "usage": {"input_tokens": 800, **USAGE}}
    engine.decision = Reply(200, orjson.dumps(answer))
    where, body = ASKS[ask]
    async with withheld.client() as c:
        r = await c.post(where, json=body)
    assert r.status_code == 200, r.text
    for said in ("cached_tokens", "cache_n", "prompt_n"):
        assert said not in r.text, said
    # the count as a JSON value anywhere (a bare "768" can turn up inside a random hex id)
    assert not re.search(r"[:\[,]\s*768(?![\d.])", r.text)
    assert "800" in r.text or ask.startswith("responses")  # the rest of usage is the engine's


async def test_a_response_whose_cached_tokens_are_withheld_carries_no_usage(
    withheld: Gw, engine: FakeEngine
) -> None:
    """OpenAI's schema requires cached_tokens in a Response's usage, and a count is never made
    up: the usage is left out, as for an engine that does not report it."""
    engine.script = vllm_stream(usage=USAGE)
    async with withheld.client() as c:
        r = await c.post("/v1/responses", json={"model": "my-model", "input": "x"})
    assert r.json()["status"] == "completed" and "usage" not in r.json()


@pytest.mark.parametrize("ask", ["chat", "chat stream", "responses", "decisions"])
async def test_by_default_cached_tokens_are_shown(
    gateway: Gw, engine: FakeEngine, ask: str
) -> None:
    engine.script = vllm_stream(usage=USAGE)
    answer = {"answers": {}, "model": "tiny", "usage": {"input_tokens": 800, **USAGE}}
    engine.decision = Reply(200, orjson.dumps(answer))
    where, body = ASKS[ask]
    async with gateway.client() as c:
        r = await c.post(where, json=body)
    assert '"cached_tokens":768' in r.text.replace(" ", "")
