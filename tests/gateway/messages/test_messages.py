"""``POST /v1/messages`` against the fake engine: what the engine is asked, what the client
gets, each answer and event held strictly to the official ``anthropic`` SDK's own types
(``anthropic_types``), through that SDK too, with one process and with two workers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import anyio
import httpx
import orjson
import pytest
from anyio import to_thread

from tests.eventually import eventually
from tests.gateway.anthropic_types import sse_events, validate_error, validate_message
from tests.gateway.conftest import KEY, WORKERS, Gw, deployments
from tests.gateway.fake_engine import DONE, FakeEngine, Gate, Hold, Reply, chunk, event
from tests.gateway.management.test_metrics import samples, scrape

pytestmark = pytest.mark.anyio
workers = WORKERS
MakeGateway = Callable[..., Awaitable[Gw]]

USAGE = {
    "prompt_tokens": 9,
    "completion_tokens": 5,
    "total_tokens": 14,
    "prompt_tokens_details": {"cached_tokens": 4},
}
CALL = {"index": 0, "id": "call_9", "type": "function", "function": {"name": "weather"}}
HELLO = [{"role": "user", "content": "Hello"}]


def script(
    *deltas: dict[str, Any], finish: str = "stop", usage: Any = USAGE, **choice: Any
) -> list[bytes]:
    items = [event(chunk(delta={"role": "assistant", "content": ""}))]
    items += [event(chunk(delta=d)) for d in deltas]
    last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish, **choice}
    items.append(event(chunk(choices=[last])))
    if usage is not None:
        items.append(event(chunk(choices=[], usage=usage)))
    return [*items, DONE]


MIXED = script(
    {"reasoning": "Think"},
    {"reasoning": "ing."},
    {"content": "Let me "},
    {"content": "look."},
    {"tool_calls": [{**CALL, "function": {"name": "weather", "arguments": '{"city"'}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]},
    {"tool_calls": [{"index": 1, "id": "call_10", "function": {"name": "time"}}]},
    finish="tool_calls",
)


@pytest.fixture
async def gateway(engine: FakeEngine, make_gateway: MakeGateway) -> Gw:
    """Chat deployments on the fake engine: vLLM (``my-model``, and ``thinker`` with a
    reasoning parser), llama.cpp (``llama``), TensorFold (``tf``); and a decisions one."""
    return await make_gateway(
        {
            "deployments": [
                deployments(engine.url),
                deployments(engine.url, name="thinker", reasoning=True),
                deployments(engine.url, name="llama", engine="llamacpp", engine_version="b10798"),
                deployments(engine.url, name="tf", engine="tensorfold", engine_version="0.6.1"),
                deployments(
                    engine.url,
                    name="decider",
                    api="decisions",
                    engine="tensorfold",
                    engine_version="0.6.1",
                ),
            ]
        }
    )


def ask(**over: Any) -> dict[str, Any]:
    return {"model": "my-model", "max_tokens": 64, "messages": HELLO, **over}


async def test_a_whole_message_is_anthropics_shape_with_our_figures_in_a_header(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = script({"content": "Hi "}, {"content": "there."})
    async with gateway.client() as c:
        r = await c.post("/v1/messages", json=ask(), headers={"X-Request-Id": "caller-1"})
    assert r.status_code == 200, r.text
    assert r.headers["X-Request-Id"] == "caller-1" and len(r.headers["X-CapyCTL-Request-Id"]) == 26
    message = validate_message(r.json())
    assert message.model == "my-model" and message.role == "assistant"
    assert [b.model_dump() for b in message.content] == [
        {"type": "text", "text": "Hi there.", "citations": None}
    ]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert r.json()["usage"] == {
        "input_tokens": 5,  # the prompt's 9 less the 4 read from the cache
        "cache_read_input_tokens": 4,
        "cache_creation_input_tokens": 0,
        "output_tokens": 5,
    }
    assert "ttft_ms" in orjson.loads(r.headers["X-CapyCTL-Metrics"])
    sent = engine.received[-1].body
    assert sent["model"] == "tiny" and sent["stream"] is True and sent["max_tokens"] == 64
    assert sent["messages"] == HELLO
    assert sent["stream_options"] == {"include_usage": True}


async def test_a_stream_is_anthropics_events_in_order_with_the_figures_before_its_end(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = MIXED
    body = ask(model="thinker", stream=True, tools=[WEATHER, TIME])
    async with gateway.client() as c:
        r = await c.post("/v1/messages", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events, comments = sse_events(r.text)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use", "tool_use"]
    assert kinds.count("content_block_stop") == 4
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "Thinking."
    assert "".join(d.get("text", "") for d in deltas) == "Let me look."
    assert "".join(d.get("partial_json", "") for d in deltas) == '{"city": "Oslo"}'
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 5
    (comment,) = comments
    assert comment.startswith(": x-capyctl-metrics ")
    assert r.text.index("message_stop") < r.text.index("x-capyctl-metrics")


WEATHER = {
    "name": "weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    "cache_control": {"type": "ephemeral"},
}
TIME = {"name": "time", "input_schema": {"type": "object"}}


async def test_the_anthropic_client_reads_whole_streamed_and_helper_messages(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = MIXED
    tools: Any = [WEATHER, TIME]
    kw: Any = {"model": "thinker", "max_tokens": 64, "messages": HELLO, "tools": tools}
    async with anthropic.AsyncAnthropic(
        base_url=gateway.url, api_key=gateway.key, max_retries=0
    ) as client:
        whole = await client.messages.create(**kw)
        assert [b.type for b in whole.content] == ["thinking", "text", "tool_use", "tool_use"]
        use = whole.content[2]
        assert use.type == "tool_use" and use.input == {"city": "Oslo"} and use.id == "call_9"
        assert whole.content[3].type == "tool_use" and whole.content[3].input == {}
        assert whole.stop_reason == "tool_use"
        stream = await client.messages.create(**kw, stream=True)
        kinds = [ev.type async for ev in stream]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        async with client.messages.stream(**kw) as helper:
            texts = [t async for t in helper.text_stream]
            final = await helper.get_final_message()
        assert "".join(texts) == "Let me look."
        dumped = [b.model_dump(exclude={"parsed_output"}) for b in final.content]
        assert dumped == [b.model_dump() for b in whole.content]
        assert final.stop_reason == "tool_use"
        assert final.usage.input_tokens == 5 and final.usage.cache_read_input_tokens == 4

    def sync() -> str:
        client = anthropic.Anthropic(base_url=gateway.url, api_key=gateway.key, max_retries=0)
        with client, client.messages.stream(**kw) as helper:
            block = helper.get_final_message().content[1]
            return block.text if block.type == "text" else ""

    assert await to_thread.run_sync(sync) == "Let me look."


async def test_a_claude_code_shaped_request_becomes_the_engines_chat_request(
    gateway: Gw, engine: FakeEngine
) -> None:
    """System blocks (Claude Code's billing line left out), tools, a tool_use answered by a
    tool_result (with is_error), thinking sent back, metadata, cache_control marks; the betas
    and version Claude Code sends, and its ``?beta=true``."""
    engine.script = script({"content": "ok"})
    body = {
        "model": "thinker",
        "max_tokens": 4096,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=fa690;"},
            {"type": "text", "text": "You are an agent. ", "cache_control": {"type": "ephemeral"}},
            {
                "type": "text",
                "text": "Be brief.",
                "cache_control": {"type": "ephemeral", "ttl": "1h"},
            },
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "weather",
                        "input": {"city": "Oslo"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "is_error": False,
                        "content": [{"type": "text", "text": "sunny"}],
                    },
                    {
                        "type": "text",
                        "text": "And tomorrow?",
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            },
        ],
        "tools": [WEATHER],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "metadata": {"user_id": "user_abc_session_1"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "max"},
        "temperature": 1,
        "top_k": 40,
        "stream": True,
    }
    betas = "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27"
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": betas}
    async with gateway.client() as c:
        r = await c.post("/v1/messages?beta=true", json=body, headers=headers)
    assert r.status_code == 200, r.text
    events, _ = sse_events(r.text)
    assert events[-1]["type"] == "message_stop"
    sent = engine.received[-1].body
    assert sent["messages"] == [
        {"role": "system", "content": "You are an agent. Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": WEATHER["input_schema"],
                "description": "The weather in a city",
            },
        }
    ]
    assert sent["tool_choice"] == "auto" and sent["parallel_tool_calls"] is False
    assert sent["user"] == "user_abc_session_1" and sent["reasoning_effort"] == "high"
    assert sent["thinking_token_budget"] == 1024
    assert (sent["temperature"], sent["top_k"]) == (1, 40)
    for key in ("system", "metadata", "thinking", "context_management", "output_config"):
        assert key not in sent


@pytest.mark.parametrize(
    ("finish", "choice", "stops", "reason", "sequence"),
    [
        ("length", {}, None, "max_tokens", None),
        ("stop", {"stop_reason": "END"}, ["END"], "stop_sequence", "END"),
        ("stop", {"stop_reason": None}, ["END"], "end_turn", None),
        ("stop", {"stop_reason": 2}, ["END"], "end_turn", None),  # a stop token, not a sequence
    ],
)
async def test_the_finish_reason_becomes_the_stop_reason(
    gateway: Gw,
    engine: FakeEngine,
    finish: str,
    choice: dict[str, Any],
    stops: Any,
    reason: str,
    sequence: str | None,
) -> None:
    engine.script = script({"content": "cut"}, finish=finish, **choice)
    over = {} if stops is None else {"stop_sequences": stops}
    async with gateway.client() as c:
        whole = (await c.post("/v1/messages", json=ask(**over))).json()
        streamed = await c.post("/v1/messages", json=ask(stream=True, **over))
    message = validate_message(whole)
    assert (message.stop_reason, message.stop_sequence) == (reason, sequence)
    if stops:
        assert engine.received[-1].body["stop"] == stops
    events, _ = sse_events(streamed.text)
    assert events[-2]["delta"] == {"stop_reason": reason, "stop_sequence": sequence}


async def test_thinking_on_a_deployment_without_a_reasoning_parser_is_refused(
    gateway: Gw, engine: FakeEngine
) -> None:
    """Its engine streams no reasoning apart: the gateway says so rather than answer without
    thinking blocks. Reasoning an engine streams anyway becomes thinking blocks, and
    ``display: omitted`` sends them empty."""
    async with gateway.client() as c:
        r = await c.post(
            "/v1/messages",
            json=ask(thinking={"type": "enabled", "budget_tokens": 2048}, max_tokens=4096),
        )
        assert r.status_code == 400
        assert "reasoning: true" in validate_error(r.json()).error.message
        engine.script = script({"reasoning": "hm"}, {"content": "ok"})
        omitted = ask(model="thinker", thinking={"type": "adaptive", "display": "omitted"})
        got = validate_message((await c.post("/v1/messages", json=omitted)).json())
    assert [b.model_dump() for b in got.content][0] == {
        "type": "thinking",
        "thinking": "",
        "signature": "",
    }


async def test_a_fault_mid_stream_is_an_error_event_and_closes_the_engine(
    gateway: Gw, engine: FakeEngine
) -> None:
    gate = Gate(asyncio.Event())
    engine.script = [
        event(chunk(delta={"role": "assistant", "content": ""})),
        event(chunk(delta={"content": "Hel"})),
        gate,
        event(chunk(delta={"content": "lo", "invented": 1})),
        Hold(),
    ]
    text = ""
    async with gateway.client() as c, c.stream("POST", "/v1/messages", json=ask(stream=True)) as r:
        async for part in r.aiter_text():
            text += part
            if "text_delta" in text:
                gate.opened.set()  # the text was relayed: now the fault
        with anyio.fail_after(5):
            await engine.hung_up.wait()  # the gateway closed the engine's connection
    events, comments = sse_events(text)
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "error",
    ]  # fmt: skip
    error = events[-1]["error"]
    assert error["type"] == "api_error" and error["message"].startswith("stream_unverified: ")
    assert events[-1]["request_id"] == r.headers["X-CapyCTL-Request-Id"]
    assert not comments  # no figures for an answer that failed


async def test_a_hang_up_closes_the_engines_connection_and_frees_the_slot(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = [*script({"content": "Hel"})[:2], Hold()]
    async with gateway.client() as c, c.stream("POST", "/v1/messages", json=ask(stream=True)) as r:
        async for line in r.aiter_lines():
            if "text_delta" in line:
                break  # hang up with the answer under way
    with anyio.fail_after(5):
        await engine.hung_up.wait()
    queue = gateway.gateway.fleet.routes["my-model"].queue
    await eventually(lambda: queue.running == 0)


async def test_a_quiet_engine_gets_the_client_pings(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    """Pings leave every quarter of the stream idle timeout while the engine is quiet; they
    keep nothing alive past it."""
    gw = await make_gateway(
        {"queue": {"stream_idle_timeout": "0.4s"}, "deployments": [deployments(engine.url)]}
    )
    gate = Gate(asyncio.Event())
    engine.script = [*script({"content": "Hel"})[:2], gate, *script({"content": "lo"})[1:]]
    text = ""
    async with gw.client() as c, c.stream("POST", "/v1/messages", json=ask(stream=True)) as r:
        async for part in r.aiter_text():
            text += part
            if text.count("event: ping") >= 3:
                gate.opened.set()  # two pings while the engine held its answer
    events, _ = sse_events(text)
    assert [e["type"] for e in events].count("ping") >= 3
    assert events[-1]["type"] == "message_stop"
    assert "".join(e["delta"].get("text", "") for e in events if "delta" in e) == "Hello"


async def test_messages_count_under_their_own_api(gateway: Gw, engine: FakeEngine) -> None:
    engine.script = script({"content": "ok"})
    async with gateway.client() as c:
        for _ in range(2):
            assert (await c.post("/v1/messages", json=ask())).status_code == 200
        await c.post("/v1/messages", json=ask(n=2))
    got = samples((await scrape(gateway)).text)
    key = (("api", "messages"), ("deployment", "my-model"))
    assert got[("capyctl_requests_total", (*key, ("outcome", "completed")))] == 2
    assert got[("capyctl_requests_total", (*key, ("outcome", "refused")))] == 1


async def test_the_key_as_x_api_key_or_bearer(gateway: Gw, engine: FakeEngine) -> None:
    engine.script = script({"content": "ok"})
    cases = [
        ({"x-api-key": KEY}, 200),
        ({"Authorization": f"Bearer {KEY}"}, 200),
        ({"x-api-key": KEY, "Authorization": f"Bearer {KEY}"}, 200),
        ({"x-api-key": "wrong"}, 401),
        ({"x-api-key": KEY, "Authorization": "Bearer wrong"}, 401),
        ({"Authorization": f"Bearer {KEY}", "x-api-key": "wrong"}, 401),
        ({}, 401),
    ]
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        for headers, status in cases:
            r = await c.post("/v1/messages", json=ask(), headers=headers)
            assert r.status_code == status, (headers, r.text)
            if status == 401:
                assert validate_error(r.json()).error.type == "authentication_error"


async def test_an_engine_refusal_reaches_the_client_in_anthropics_shape(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = Reply(400, b'{"error": {"message": "prompt too long", "code": 400}}')
    async with gateway.client() as c:
        r = await c.post("/v1/messages", json=ask())
    assert r.status_code == 400
    error = validate_error(r.json()).error
    assert error.type == "invalid_request_error" and "prompt too long" in error.message
