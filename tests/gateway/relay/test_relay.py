"""Relaying and collecting engine streams: verification, refusals, metrics, hang-ups."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
import pytest

from tests.gateway.conftest import ONE, WORKERS, Gw, deployments
from tests.gateway.fake_engine import (
    DONE,
    FakeEngine,
    Hold,
    Pause,
    Reply,
    chunk,
    event,
    vllm_stream,
)

workers = WORKERS


pytestmark = pytest.mark.anyio
CHAT = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}]}


def data_events(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[6:]
            out.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return out


async def stream(gw: Gw, body: dict[str, Any] | None = None) -> tuple[int, dict[str, str], str]:
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json={**(body or CHAT), "stream": True})
        return r.status_code, dict(r.headers), r.text


async def collect(gw: Gw, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=body or CHAT)
        return r.status_code, r.json()


# -- relaying -------------------------------------------------------------------------------
async def test_stream_is_relayed_with_the_public_name_metrics_then_done(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = vllm_stream(
        usage={
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "total_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
        metrics={
            "time_to_first_token_ms": 40.0,
            "queue_time_ms": 2.0,
            "mean_itl_ms": 10.0,
            "generation_time_ms": 60.0,
            "tokens_per_second": 50.0,
        },
    )
    status, headers, text = await stream(gateway)
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    events = data_events(text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["model"] for c in chunks} == {"my-model"}
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        == "Hello!"
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["metrics"]["mean_itl_ms"] == 10.0
    comment = [line for line in text.split("\n") if line.startswith(": x-capyctl-metrics ")]
    assert len(comment) == 1
    assert text.index(comment[0]) < text.index("data: [DONE]")
    figures = orjson.loads(comment[0].removeprefix(": x-capyctl-metrics "))
    assert figures == {
        "cached_tokens": {"value": 0, "source": "engine"},
        "decode_tokens_per_second": {"value": 100.0, "source": "engine"},
        "prefill_ms": {"value": 40.0, "source": "engine"},
        "queue_ms": {"value": 2.0, "source": "engine"},
        "ttft_ms": {"value": 42.0, "source": "engine"},
    }
    sent = engine.received[0].body
    assert sent["stream"] is True and sent["model"] == "tiny" and "stream_options" not in sent


async def test_without_engine_figures_the_router_measures_and_nothing_else_is_invented(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = vllm_stream()  # no usage, no metrics object
    _, _, text = await stream(gateway)
    comment = next(line for line in text.split("\n") if line.startswith(": x-capyctl-metrics "))
    figures = orjson.loads(comment.removeprefix(": x-capyctl-metrics "))
    assert set(figures) == {"ttft_ms"}
    assert figures["ttft_ms"]["source"] == "router" and figures["ttft_ms"]["value"] >= 0


async def test_a_non_streaming_client_gets_the_stream_folded_into_one_answer(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = [
        event(chunk(delta={"role": "assistant", "content": ""})),
        event(chunk(delta={"reasoning": "think"})),
        event(chunk(delta={"content": "Hel"})),
        Pause(0.05),  # a measurable decode span for the router's figure
        event(
            chunk(
                delta={
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"a"'},
                        }
                    ]
                }
            )
        ),
        event(chunk(delta={"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]})),
        event(chunk(delta={"content": "lo"}, finish="tool_calls")),
        event(
            chunk(
                choices=[],
                usage={"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10},
                metrics={"time_to_first_token_ms": 5.0, "queue_time_ms": 1.0, "mean_itl_ms": 0.0},
            )
        ),
        DONE,
    ]
    status, body = await collect(gateway)
    assert status == 200
    assert body["object"] == "chat.completion" and body["model"] == "my-model"
    message = body["choices"][0]["message"]
    assert message["content"] == "Hello" and message["reasoning"] == "think"
    assert message["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    ]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["usage"]["completion_tokens"] == 6
    assert body["metrics"]["queue_time_ms"] == 1.0  # the engine's own object, unchanged
    figures = body["capyctl"]["metrics"]
    assert figures["queue_ms"] == {"value": 1.0, "source": "engine"}
    assert figures["decode_tokens_per_second"]["source"] == "router"  # itl 0: not measured
    assert engine.received[0].body["stream_options"] == {"include_usage": True}


async def test_comment_lines_from_the_engine_are_not_relayed(
    gateway: Gw, engine: FakeEngine
) -> None:
    script = vllm_stream()
    engine.script = [b": ping\n\n", *script[:2], b": keep-alive\n\n", *script[2:]]
    status, _, text = await stream(gateway)
    assert status == 200
    assert ": ping" not in text and ": keep-alive" not in text
    assert text.rstrip().endswith("data: [DONE]")


async def test_llamacpp_timings_give_engine_figures(gateway: Gw, engine: FakeEngine) -> None:
    engine.script = [
        event(
            chunk(delta={"role": "assistant", "content": None}, system_fingerprint="b10798-unknown")
        ),
        event(chunk(delta={"content": "ab"}, system_fingerprint="b10798-unknown")),
        event(
            chunk(
                delta={},
                finish="length",
                system_fingerprint="b10798-unknown",
                timings={"prompt_ms": 1.5, "predicted_per_second": 2000.0, "predicted_n": 2},
            )
        ),
        DONE,
    ]
    status, body = await collect(gateway, {**CHAT, "model": "llama"})
    assert status == 200
    assert body["timings"]["prompt_ms"] == 1.5 and body["system_fingerprint"] == "b10798-unknown"
    figures = body["capyctl"]["metrics"]
    assert figures["prefill_ms"] == {"value": 1.5, "source": "engine"}
    assert figures["decode_tokens_per_second"] == {"value": 2000.0, "source": "engine"}
    assert figures["ttft_ms"]["source"] == "router"
    assert "queue_ms" not in figures and "cached_tokens" not in figures  # no cache_n sent


async def test_llamacpps_cached_tokens_come_from_its_timings_without_usage(
    gateway: Gw, engine: FakeEngine
) -> None:
    """A llama.cpp stream without include_usage still says what it took from its cache
    (``timings.cache_n``): the figure was left out although the engine reported it."""
    timings = {"cache_n": 23, "prompt_n": 5, "prompt_ms": 1.5, "predicted_per_second": 900.0}
    engine.script = [
        event(chunk(delta={"role": "assistant", "content": None})),
        event(chunk(delta={"content": "ab"})),
        event(chunk(delta={}, finish="stop", timings=timings)),
        DONE,
    ]
    status, _, text = await stream(gateway, {**CHAT, "model": "llama", "stream": True})
    comment = next(x for x in text.split("\n") if x.startswith(": x-capyctl-metrics "))
    figures = orjson.loads(comment.removeprefix(": x-capyctl-metrics "))
    assert status == 200 and figures["cached_tokens"] == {"value": 23, "source": "engine"}


async def test_tensorfolds_cuda_qwen_figures_are_its_prefill_and_the_routers_timing(
    make_gateway: Callable[..., Awaitable[Gw]], engine: FakeEngine
) -> None:
    """The guide's CUDA Qwen row: prefill from ``prefill_s``, time to first token and decode
    speed the router's (they were left out, or taken from fields that object does not mean)."""
    stats = {"prefill_s": 0.25, "time_to_first_token": 9.0, "tokens_per_second": 1.0}
    engine.script = [
        event(chunk(delta={"role": "assistant", "content": ""})),
        event(chunk(delta={"content": "ab"})),
        event(chunk(delta={"content": "cd"})),
        event(
            chunk(
                delta={},
                finish="stop",
                tensorfold=stats,
                usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            )
        ),
        DONE,
    ]
    tf = deployments(engine.url, name="tf-chat", engine="tensorfold", engine_version="0.6.1")
    gw = await make_gateway({"deployments": [tf]})
    status, body = await collect(gw, {**CHAT, "model": "tf-chat"})
    figures = body["capyctl"]["metrics"]
    assert status == 200 and figures["prefill_ms"] == {"value": 250.0, "source": "engine"}
    assert figures["ttft_ms"]["source"] == "router"
    # not the object's tokens_per_second (the router's, where it timed one)
    assert figures.get("decode_tokens_per_second", {"source": "router"})["source"] == "router"


# -- verification -----------------------------------------------------------------------------
BROKEN: dict[str, list[Any]] = {
    "unknown delta key": [event(chunk(delta={"content": "a", "citations": []}))],
    "reasoning_content on vLLM": [event(chunk(delta={"reasoning_content": "x"}))],
    "duplicate key": [
        b'data: {"id":"chatcmpl-1","id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'
    ],
    "changing id": [
        event(chunk(delta={"content": "a"})),
        event(chunk(delta={"content": "b"}, cid="other")),
    ],
    "malformed chunk": [b"data: {not json\n\n"],
    "other model": [event(chunk(delta={"content": "a"}, model="someone-else"))],
    "two choices": [event(chunk(choices=[{"index": 0, "delta": {}}, {"index": 1, "delta": {}}]))],
    "event field": [b"event: ping\ndata: {}\n\n"],
    "done before finish": [event(chunk(delta={"content": "a"})), DONE],
    "unknown finish reason": [event(chunk(delta={"content": "a"}, finish="abort"))],
    # issue 42, item 11: not one coherent choice
    "a second choice": [event(chunk(choices=[{"index": 1, "delta": {"content": "b"}}]))],
    "a nameless tool call": [
        event(chunk(delta={"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}))
    ],
    "a tool call whose id changes": [
        event(chunk(delta={"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f"}}]})),
        event(chunk(delta={"tool_calls": [{"index": 0, "id": "b", "function": {}}]})),
    ],
    "usage counted in words": [event(chunk(choices=[], usage={"prompt_tokens": "five"}))],
    # chunk-level fields: only those of the engine's row (llama.cpp's timings are not vLLM's)
    "timings on vLLM": [event(chunk(delta={"content": "a"}, timings={"prompt_ms": 1.0}))],
    "invented chunk field": [event(chunk(delta={"content": "a"}, x_debug="10.0.0.7"))],
    "token ids with a value": [event(chunk(delta={"content": "a"}, prompt_token_ids=[1, 2]))],
}


@pytest.mark.parametrize("case", sorted(BROKEN))
async def test_a_broken_stream_ends_unverified_without_done(
    gateway: Gw, engine: FakeEngine, case: str
) -> None:
    opening = [event(chunk(delta={"role": "assistant", "content": ""}))]
    engine.script = [*opening, *BROKEN[case], *vllm_stream()[1:]]
    status, _, text = await stream(gateway)
    assert status == 200
    events = data_events(text)
    assert "[DONE]" not in events
    assert events[-1]["error"]["code"] == "stream_unverified"
    assert "x-capyctl-metrics" not in text


async def test_an_unverified_field_is_named_in_the_log_not_to_the_client(
    gateway: Gw, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine chose the name: it may say anything (an address), so only the log has it."""
    opening = event(chunk(delta={"role": "assistant", "content": ""}))
    odd: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"content": "a"}, {"10.0.0.7:8000": 1}),  # a chunk field
        ({"content": "a", "gpu-3.internal": 1}, {}),  # a delta key
    ]
    for delta, extra in odd:
        engine.script = [opening, event(chunk(delta=delta, **extra)), *vllm_stream()[1:]]
        _, _, text = await stream(gateway)
        assert data_events(text)[-1]["error"]["code"] == "stream_unverified"
        assert "10.0.0.7" not in text and "gpu-3.internal" not in text
    assert "10.0.0.7:8000" in caplog.text and "gpu-3.internal" in caplog.text


@pytest.mark.parametrize(
    "case", ["unknown delta key", "duplicate key", "changing id", "invented chunk field"]
)
async def test_a_broken_stream_is_a_502_for_a_non_streaming_client(
    gateway: Gw, engine: FakeEngine, case: str
) -> None:
    engine.script = [*BROKEN[case], *vllm_stream()[1:]]
    status, body = await collect(gateway)
    assert status == 502
    assert body["code"] == "engine_error"


async def test_vllms_own_chunk_fields_are_relayed_as_it_sends_them(
    gateway: Gw, engine: FakeEngine
) -> None:
    """As captured from vLLM 0.31.0: null token ids on the opening chunk, a system fingerprint
    and the metrics object on the usage chunk."""
    opening = chunk(delta={"role": "assistant", "content": ""})
    opening |= {"prompt_token_ids": None, "prompt_text": None}
    tail = chunk(choices=[], usage={"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6})
    tail |= {"system_fingerprint": "vllm-0.31.0-b289ab4b", "metrics": {"mean_itl_ms": 10.0}}
    engine.script = [event(opening), *vllm_stream()[1:-1], event(tail), DONE]
    status, _, text = await stream(gateway)
    events = data_events(text)
    assert status == 200 and events[-1] == "[DONE]", events[-2:]
    assert events[0]["prompt_token_ids"] is None and "prompt_text" in events[0]
    assert events[-2]["system_fingerprint"] == "vllm-0.31.0-b289ab4b"


async def test_a_truncated_stream_is_unverified(gateway: Gw, engine: FakeEngine) -> None:
    engine.script = vllm_stream()[:-1]  # everything but [DONE]
    _, _, text = await stream(gateway)
    assert data_events(text)[-1]["error"]["code"] == "stream_unverified"
    status, body = await collect(gateway)
    assert (status, body["code"]) == (502, "engine_error")


async def test_a_content_colon_does_not_trip_the_duplicate_key_check(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = vllm_stream(texts=('he said "x": y', ' {"a": 1}'))
    status, body = await collect(gateway)
    assert status == 200
    assert body["choices"][0]["message"]["content"] == 'he said "x": y {"a": 1}'


# -- engine refusals --------------------------------------------------------------------------
@pytest.mark.parametrize("status", [400, 413, 422])
async def test_engine_refusals_keep_their_status(
    gateway: Gw, engine: FakeEngine, status: int
) -> None:
    long = "x" * 2000
    engine.script = Reply(
        status, orjson.dumps({"error": {"message": f"too long {long}", "code": status}})
    )
    got, body = await collect(gateway)
    assert got == status
    assert body["code"] == "engine_rejected"
    assert body["message"].startswith("too long") and len(body["message"].encode()) <= 512


@pytest.mark.parametrize(
    "reply",
    [Reply(500, b'{"error": "boom"}'), Reply(400, b"plain", "text/plain"), Reply(200, b"{}")],
)
async def test_other_engine_failures_are_502(gateway: Gw, engine: FakeEngine, reply: Reply) -> None:
    engine.script = reply
    status, body = await collect(gateway)
    assert (status, body["code"]) == (502, "engine_error")


async def test_an_in_stream_refusal_before_any_chunk_is_engine_rejected(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = [event({"error": {"code": 400, "message": "prompt too long for the KV pool"}})]
    status, headers, text = await stream(gateway)
    assert status == 400
    assert orjson.loads(text) == {
        "code": "engine_rejected",
        "message": "prompt too long for the KV pool",
    }
    assert "x-capyctl-request-id" in headers


async def test_an_unreachable_engine_is_502(make_gateway: Callable[..., Awaitable[Gw]]) -> None:
    gw = await make_gateway({"deployments": [deployments("http://127.0.0.1:9")]})
    status, body = await collect(gw)
    assert (status, body["code"]) == (502, "engine_error")


# -- deadlines and hang-ups --------------------------------------------------------------------
async def test_no_first_token_within_the_deadline_is_503_and_closes_the_engine_connection(
    engine: FakeEngine, make_gateway: Callable[..., Awaitable[Gw]]
) -> None:
    engine.script = [event(chunk(delta={"role": "assistant", "content": ""})), Hold()]
    gw = await make_gateway(
        {"queue": {"request_deadline": "300ms"}, "deployments": [deployments(engine.url)]}
    )
    status, body = await collect(gw)
    assert status == 503 and body == {
        "code": "unavailable",
        "message": "no output within queue.request_deadline",
        "retryable": True,
    }
    with anyio.fail_after(5):
        await engine.hung_up.wait()  # the role-only chunk did not count as output


async def test_a_quiet_stream_is_cut_at_the_idle_timeout(
    engine: FakeEngine, make_gateway: Callable[..., Awaitable[Gw]]
) -> None:
    engine.script = [*vllm_stream()[:2], Hold()]
    gw = await make_gateway(
        {"queue": {"stream_idle_timeout": "300ms"}, "deployments": [deployments(engine.url)]}
    )
    status, _, text = await stream(gw)
    assert status == 200
    events = data_events(text)
    assert events[-1]["error"]["code"] == "unavailable" and "[DONE]" not in events
    with anyio.fail_after(5):
        await engine.hung_up.wait()


async def test_a_client_hang_up_mid_stream_closes_the_engine_connection(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = [*vllm_stream()[:2], Hold()]
    async with (
        gateway.client() as c,
        c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r,
    ):
        async for line in r.aiter_lines():
            if "Hel" in line:
                break  # leave: the client closes its connection
    with anyio.fail_after(5):
        await engine.hung_up.wait()
    assert engine.finished == 0


async def test_a_non_streaming_client_hang_up_before_the_first_token_closes_it_too(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = [Hold()]

    async def ask() -> None:
        async with gateway.client() as c:
            await c.post("/v1/chat/completions", json=CHAT)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask)
        with anyio.fail_after(5):
            await engine.arrived.wait()
        tg.cancel_scope.cancel()  # the client gives up and closes its connection
    with anyio.fail_after(5):
        await engine.hung_up.wait()


@ONE
async def test_a_completed_exchange_leaves_its_engine_connection_in_the_pool(
    gateway: Gw, engine: FakeEngine
) -> None:
    # [DONE], then the end of the chunked body in a later write, as uvicorn (vLLM, SGLang)
    # sends them: the relay waits for that end instead of closing the connection.
    engine.script = [*vllm_stream(), Pause(0.05)]
    async with gateway.client() as c:
        for body in ({**CHAT, "stream": True}, CHAT, {**CHAT, "stream": True}, CHAT):
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
            # The connection goes back to the pool once the body's end came (after the answer).
            await asyncio.gather(*gateway.gateway.fleet.drains)
    peers = {r.peer for r in engine.received}
    assert len(engine.received) == 4 and len(peers) == 1, peers


@ONE
@pytest.mark.parametrize("stream", [True, False])
async def test_an_engine_that_never_ends_its_body_after_done_is_closed_not_pooled(
    gateway: Gw, engine: FakeEngine, stream: bool
) -> None:
    engine.script = [*vllm_stream(), Hold()]  # [DONE], then the body never ends
    async with gateway.client() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        # The answer did not wait for the body's end (1 s), nor did the request's queue place.
        assert not engine.hung_up.is_set()
        assert gateway.gateway.fleet.routes["my-model"].queue.running == 0 or stream
    assert r.status_code == 200
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["choices"][0]["message"]["content"] == "Hello!"
    with anyio.fail_after(5):
        await engine.hung_up.wait()  # closed, not left open in the pool
    assert gateway.gateway.fleet.settlement.ledgers["my-model/0"].charged == 0  # it finished


async def test_llama_cpp_connections_are_not_reused(gateway: Gw, engine: FakeEngine) -> None:
    # llama-server closes its connection after each streamed answer without a header saying so.
    engine.script = vllm_stream()
    async with gateway.client() as c:
        for body in ({**CHAT, "model": "llama", "stream": True}, {**CHAT, "model": "llama"}):
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
    assert len({r.peer for r in engine.received}) == 2
