"""``scripts/demo``'s deployment, run by the gateway against the real llama-server: the guide's
chat, streaming and Python examples, which send no ``max_tokens``, finish (llama-server's own
``-n`` caps the tiny random model, which never ends an answer by itself)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import yaml
from openai import AsyncOpenAI

from contract.conftest import RunningGateway, serve_gateway
from contract.demo import PREDICT, demo_config

pytestmark = pytest.mark.anyio
HELLO = {"model": "my-model", "messages": [{"role": "user", "content": "Hello"}]}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def demo_gateway(
    llama_server_binary: Path, llama_models: Path, tmp_path: Path
) -> AsyncIterator[RunningGateway]:
    config = yaml.safe_load(demo_config(llama_server_binary, llama_models / "tiny.gguf"))
    async for gw in serve_gateway(config, engine_logs=tmp_path / "logs"):
        yield gw


async def test_the_guides_requests_finish_on_the_demos_engine(demo_gateway: RunningGateway) -> None:
    auth = {"Authorization": f"Bearer {demo_gateway.key}"}
    # The first request starts llama-server; none of these would end without the cap.
    async with httpx.AsyncClient(base_url=demo_gateway.url, headers=auth, timeout=120) as c:
        whole = await c.post("/v1/chat/completions", json=HELLO)
        streamed = await c.post("/v1/chat/completions", json={**HELLO, "stream": True})
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == PREDICT
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    async with AsyncOpenAI(
        base_url=demo_gateway.url + "/v1", api_key=demo_gateway.key, max_retries=0, timeout=60
    ) as client:
        reply = await client.chat.completions.create(
            model="my-model", messages=[{"role": "user", "content": "Hello"}]
        )
        stream = await client.chat.completions.create(
            model="my-model", messages=[{"role": "user", "content": "Hello"}], stream=True
        )
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    assert reply.choices[0].message.content and text
    assert reply.choices[0].logprobs is None and reply.choices[0].message.refusal is None
