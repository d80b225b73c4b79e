"""The lean engine client is the only one: ``engine_client: lean`` is accepted, the removed
aiohttp fallback is refused, and the client's pool keeps its bound."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from tests.gateway.conftest import Gw, deployments
from tests.gateway.fake_engine import FakeEngine, vllm_stream

pytestmark = pytest.mark.anyio


async def test_the_lean_client_relays_and_collects(
    engine: FakeEngine, make_gateway: Callable[..., Awaitable[Gw]]
) -> None:
    engine.script = vllm_stream(["Hel", "lo"])
    gw = await make_gateway({"engine_client": "lean", "deployments": [deployments(engine.url)]})
    assert type(gw.gateway.fleet.engines).__name__ == "EngineClient"
    body = {"model": "my-model", "messages": [{"role": "user", "content": "x"}]}
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello"
        r = await c.post("/v1/chat/completions", json={**body, "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert '"Hel"' in r.text and '"model":"my-model"' in r.text
    assert len(engine.received) == 2


def test_the_removed_aiohttp_engine_client_is_a_configuration_error() -> None:
    from pydantic import ValidationError

    from capyctl_gateway import GatewayConfig

    doc = {"engine_client": "aiohttp", "deployments": [deployments("http://127.0.0.1:9")]}
    with pytest.raises(ValidationError, match="engine_client"):
        GatewayConfig.model_validate(doc)


async def test_the_lean_client_keeps_at_most_its_bound_of_idle_connections(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from yarl import URL

    from capyctl_gateway import _engine_client

    monkeypatch.setattr(_engine_client, "MAX_IDLE_PER_ENGINE", 2)
    engine.script = vllm_stream(["x"])
    client = _engine_client.EngineClient(connect_timeout=5)
    url = URL(engine.url + "/v1/chat/completions")

    async def one() -> None:
        resp = await client.post(url, data=b'{"model":"tiny","messages":[]}', headers={})
        await resp.content.read()
        resp.release()

    await asyncio.gather(*(one() for _ in range(5)))  # five connections at once
    idle = [c for conns in client._idle.values() for c in conns]  # private: the pool itself
    assert len(idle) == 2 and all(not c.closed for c in idle)
    await client.close()
    assert all(c.closed for c in idle)
