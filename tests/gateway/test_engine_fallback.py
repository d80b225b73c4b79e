"""``engine_client: aiohttp`` keeps aiohttp's client behind the same exchange: the gateway
answers the same with either."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from tests.gateway.conftest import Gw, deployments
from tests.gateway.fake_engine import FakeEngine, vllm_stream

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("client", ["lean", "aiohttp"])
async def test_either_engine_client_relays_and_collects_the_same(
    client: str, engine: FakeEngine, make_gateway: Callable[..., Awaitable[Gw]]
) -> None:
    engine.script = vllm_stream(["Hel", "lo"])
    gw = await make_gateway({"engine_client": client, "deployments": [deployments(engine.url)]})
    kind = "EngineClient" if client == "lean" else "ClientSession"
    assert type(gw.gateway.engines).__name__ == kind
    body = {"model": "my-model", "messages": [{"role": "user", "content": "x"}]}
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello"
        r = await c.post("/v1/chat/completions", json={**body, "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert '"Hel"' in r.text and '"model":"my-model"' in r.text
    assert len(engine.received) == 2
