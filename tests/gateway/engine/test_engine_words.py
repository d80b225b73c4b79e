"""What of an engine's own words reaches a client (issue 42, item 10): its refusal's message,
on every path, without the gateway's engine key or the engine's address; and the log's copy of
what it said without the key either."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from yarl import URL

from tests.gateway.conftest import Gw, deployments
from tests.gateway.fake_engine import FakeEngine, Reply, chunk, event

pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]
ENGINE_KEY = "sk-engine-7f3a9c1e"


def said(engine: FakeEngine) -> str:
    """An engine's refusal that names what it should not: its key, bare and as the header it
    came in, and its address, whole and as host:port."""
    url = URL(engine.url)
    return (
        f"bad request at {engine.url}/v1/chat/completions (listening on {url.host}:{url.port}); "
        f"key {ENGINE_KEY} given as Authorization: Bearer {ENGINE_KEY}"
    )


def leaks(engine: FakeEngine, text: str) -> list[str]:
    url = URL(engine.url)
    return [s for s in (ENGINE_KEY, f"{url.host}:{url.port}", engine.url) if s in text]


@pytest.fixture
async def keyed(engine: FakeEngine, make_gateway: MakeGateway) -> Gw:
    """A chat deployment and a decisions one, both on the fake engine with an engine key."""
    chat = deployments(engine.url)
    decide = deployments(
        engine.url, name="decider", api="decisions", engine="tensorfold", engine_version="0.6.1"
    )
    for dep in (chat, decide):
        dep["instances"][0]["api_key_env"] = "ENGINE_KEY"
    return await make_gateway({"deployments": [chat, decide]}, env={"ENGINE_KEY": ENGINE_KEY})


REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": "my-model", "messages": []}),
    "chat stream": ("/v1/chat/completions", {"model": "my-model", "messages": [], "stream": True}),
    "responses": ("/v1/responses", {"model": "my-model", "input": "x"}),
    "responses stream": ("/v1/responses", {"model": "my-model", "input": "x", "stream": True}),
    "decisions": ("/v1/systemone", {"model": "decider", "state": "s", "questions": {}}),
}


CASES = [(path, how) for path in sorted(REQUESTS) for how in ("body", "event", "cut")]
"""Each path with the refusal as a JSON body, as an error event before any chunk (the decisions
API has no stream: a body only), and as a body whose key straddles the 512-byte cut."""


@pytest.mark.parametrize(
    ("path", "how"), [c for c in CASES if c[0] != "decisions" or c[1] != "event"]
)
async def test_an_engines_refusal_reaches_the_client_without_its_key_or_address(
    keyed: Gw, engine: FakeEngine, path: str, how: str
) -> None:
    message = said(engine)
    if how == "cut":  # masked before it is cut: no part of the key is left at the cut
        message = "bad request at " + "x" * (512 - len("bad request at ") - 6) + ENGINE_KEY
    error = {"error": {"message": message, "code": 400}}
    if how == "event":
        engine.script = [event(error)]
    else:
        engine.script = engine.decision = Reply(400, orjson.dumps(error))
    where, body = REQUESTS[path]
    async with keyed.client() as c:
        r = await c.post(where, json=body)
    assert (r.status_code, r.json()["code"]) == (400, "engine_rejected"), r.text
    assert r.json()["message"].startswith("bad request at ")
    assert leaks(engine, r.text) == []
    assert ENGINE_KEY[:6] not in r.text
    assert engine.received[0].headers["Authorization"] == f"Bearer {ENGINE_KEY}"


@pytest.mark.parametrize("path", ["chat", "chat stream", "responses", "responses stream"])
async def test_what_an_engine_said_mid_stream_reaches_the_log_without_the_key(
    keyed: Gw, engine: FakeEngine, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    caplog.set_level(logging.INFO)
    engine.script = [
        event(chunk(delta={"role": "assistant", "content": "Hi"})),
        event({"error": {"message": said(engine), "code": 500}}),
    ]
    where, body = REQUESTS[path]
    async with keyed.client() as c:
        r = await c.post(where, json=body)
    logged = caplog.text
    assert "bad request at" in logged  # the engine's words are the log's
    assert ENGINE_KEY not in logged and ENGINE_KEY not in r.text
    assert leaks(engine, r.text) == []
