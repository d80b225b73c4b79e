"""capyctl-gateway in front of a real llama-server, driven by the openai client."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import httpx
import orjson
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from canopyx_provider import Collector, Event, ProviderOptions, ScrapeSucceeded, llama_cpp
from capyctl_gateway._deployments.settle import SettleRule
from contract.conftest import RunningGateway
from contract.engines.llamacpp import LlamaServer

pytestmark = pytest.mark.anyio
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def client(gw: RunningGateway) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.url + "/v1", api_key=gw.key, max_retries=0)


async def test_openai_client_non_streamed(llama_gateway: RunningGateway) -> None:
    async with client(llama_gateway) as c:
        reply = await c.chat.completions.create(model="my-model", messages=MESSAGES, max_tokens=24)
    assert reply.model == "my-model"
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 24
    extra = reply.model_extra or {}
    figures = extra["capyctl"]["metrics"]
    assert figures["prefill_ms"]["source"] == "engine"  # llama.cpp timings.prompt_ms
    assert figures["decode_tokens_per_second"]["source"] == "engine"
    assert figures["ttft_ms"]["source"] == "router"
    assert extra["timings"]["predicted_n"] == 24  # the engine's own object, unchanged


async def test_openai_client_streamed_with_usage(llama_gateway: RunningGateway) -> None:
    text, usage, models = [], None, set()
    async with client(llama_gateway) as c:
        stream = await c.chat.completions.create(
            model="my-model",
            messages=MESSAGES,
            max_tokens=32,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            models.add(chunk.model)
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
    assert models == {"my-model"}
    assert "".join(text)
    assert usage is not None and usage.completion_tokens == 32


async def test_raw_stream_ends_with_metrics_then_done(llama_gateway: RunningGateway) -> None:
    body = {"model": "my-model", "messages": MESSAGES, "max_tokens": 8, "stream": True}
    headers = {"Authorization": f"Bearer {llama_gateway.key}", "X-Request-Id": "live-1"}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(llama_gateway.url + "/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200 and r.headers["x-request-id"] == "live-1"
    assert len(r.headers["x-capyctl-request-id"]) == 26
    lines = [line for line in r.text.split("\n") if line]
    assert lines[-1] == "data: [DONE]"
    assert lines[-2].startswith(": x-capyctl-metrics ")
    figures = orjson.loads(lines[-2].removeprefix(": x-capyctl-metrics "))
    assert figures["prefill_ms"]["source"] == "engine"


async def _until_idle(c: Collector, *, within: float) -> float:
    """Seconds until llama.cpp reports nothing processing and nothing deferred."""
    start = anyio.current_time()
    with anyio.fail_after(within):
        while True:
            snap = await c.refresh("e")
            if snap is not None and snap.metrics.idle:
                return anyio.current_time() - start
            await anyio.sleep(0.1)  # read the engine's count every 100 ms


async def both_hang_up(
    gw: RunningGateway, server: LlamaServer, path: str, body: dict[str, object]
) -> float:
    """Two clients send ``body`` to ``path`` and hang up once the engine runs both; seconds
    from then until llama.cpp reports idle (its own count, read every 100 ms)."""
    headers = {"Authorization": f"Bearer {gw.key}"}
    async with Collector(options=ProviderOptions(connect_attempts=1)) as c:
        c.add("e", llama_cpp(server.base_url), model_id="tiny", poll=False)
        assert (await c.check("e")).ok
        async with httpx.AsyncClient(timeout=60) as http, anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(lambda: http.post(gw.url + path, json=body, headers=headers))
            with anyio.fail_after(30):
                while True:
                    snap = await c.refresh("e")
                    if snap is not None and snap.metrics.running_requests == 2:
                        break
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()  # both clients hang up
        return await _until_idle(c, within=5)


@pytest.mark.parametrize("streamed", [True, False])
async def test_a_hang_up_stops_the_engine(
    llama_gateway: RunningGateway, llama_server: LlamaServer, streamed: bool
) -> None:
    """Two long generations, both clients gone once the engine runs both: the engine stops.

    Asked directly, llama.cpp keeps a non-streamed request running while anything else talks to
    it; through the gateway it is asked for a stream, so it stops the same way both times.
    """
    body = {"model": "my-model", "messages": MESSAGES, "max_tokens": 30000, "stream": streamed}
    seconds = await both_hang_up(llama_gateway, llama_server, "/v1/chat/completions", body)
    assert seconds < 1.0


async def test_a_cut_stream_settles_when_the_real_engine_reports_idle(
    llama_gateway: RunningGateway,
) -> None:
    """State after the fact: the cut request is charged, then settled by an idle sample taken
    after the cut, and the instance's charge returns to 0."""
    settlement = llama_gateway.gateway.fleet.settlement
    book = settlement.ledgers["my-model/0"]
    changed = anyio.Event()
    samples = []

    def observe(e: Event, /) -> None:
        nonlocal changed
        if isinstance(e, ScrapeSucceeded):
            samples.append(e.snapshot)
        changed.set()

    settlement.observers.append(observe)

    async def until(predicate: Callable[[], bool]) -> None:
        nonlocal changed
        with anyio.fail_after(15):
            while not predicate():
                await changed.wait()
                changed = anyio.Event()

    body = {"model": "my-model", "messages": MESSAGES, "max_tokens": 30000, "stream": True}
    headers = {"Authorization": f"Bearer {llama_gateway.key}"}
    async with (
        httpx.AsyncClient(timeout=60) as http,
        http.stream(
            "POST", llama_gateway.url + "/v1/chat/completions", json=body, headers=headers
        ) as r,
    ):
        async for line in r.aiter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # generated text arrived: hang up
    await until(lambda: settlement.settled == 1)
    (done,) = settlement.recent
    assert done.cut.rule is SettleRule.WHEN_IDLE and done.cut.reason == "hang_up"
    assert done.why == "engine idle"
    assert done.sample_requested_at is not None and done.sample_requested_at > done.cut.cut_at
    idle = [s for s in samples if s.requested_at == done.sample_requested_at]
    assert idle and idle[0].metrics.running_requests == 0 and idle[0].metrics.waiting_requests == 0
    assert book.charged == 0


async def test_requests_in_a_row_all_succeed(llama_gateway: RunningGateway) -> None:
    """llama-server closes its connection after every streamed answer, without saying so in a
    header; a gateway that pooled those connections would send the next request into a closed
    one (measured: with one connection reused, every request after a stream failed)."""
    body = {
        "model": "my-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    }
    headers = {"Authorization": f"Bearer {llama_gateway.key}"}
    statuses = []
    async with httpx.AsyncClient(base_url=llama_gateway.url, headers=headers, timeout=60) as c:
        for i in range(30):
            r = await c.post("/v1/chat/completions", json={**body, "stream": i % 2 == 0})
            statuses.append(r.status_code)
    assert statuses == [200] * 30


@pytest.mark.parametrize("logprobs", [False, True])
async def test_openai_client_parses_every_field_the_gateway_sent(
    llama_gateway: RunningGateway, logprobs: bool
) -> None:
    async with client(llama_gateway) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model="my-model", messages=MESSAGES, max_tokens=8, logprobs=logprobs
        )
        one = await c.models.retrieve("my-model")
        listed = await c.models.list()
    wire = orjson.loads(raw.http_response.content)
    reply = raw.parse()
    assert reply.model_dump(mode="json", exclude_unset=True) == wire
    assert len(raw.headers["X-CapyCTL-Request-Id"]) == 26
    (choice,) = reply.choices
    assert {"logprobs", "finish_reason", "index"} <= choice.model_fields_set
    assert {"role", "content", "refusal"} <= choice.message.model_fields_set
    assert choice.message.refusal is None
    if logprobs:  # llama.cpp's own, one per generated token, joined by the gateway
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == 8
        assert all(t.token and t.logprob <= 0 for t in choice.logprobs.content)
    else:
        assert choice.logprobs is None
    assert one == listed.data[0] and one.id == "my-model"
