"""``/v1/messages`` and ``/v1/messages/count_tokens`` through the gateway to a real llama-server
and a real vLLM (CPU), driven by the official ``anthropic`` client: every Message and event the
gateway sends is also held strictly to that SDK's own types (the raw bytes, read beside it).

The models are tiny and random: what they say means nothing, so a tool call is asked for by
``tool_choice`` (vLLM then constrains its output to the call) and each answer is judged by its
shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import pytest
from tests.gateway.anthropic_types import sse_events, validate_count, validate_message

from contract.conftest import RunningGateway, serve_gateway
from contract.engines.llamacpp import LlamaServer
from contract.live.test_gateway_llamacpp_live import both_hang_up
from contract.live.test_responses_live import cut_gateway

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]
__all__ = ["cut_gateway"]  # the fixture, used here too

WEATHER: Any = {
    "name": "weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
SYSTEM: Any = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37; cch=fa690;"},
    {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
]
BETAS = (
    "claude-code-20250219,interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14"
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["llamacpp", "vllm"])
def target(request: pytest.FixtureRequest) -> tuple[str, str, str]:
    """The engine a test's gateway is in front of: kind, version, base URL."""
    if request.param == "llamacpp":
        server: LlamaServer = request.getfixturevalue("llama_server")
        return "llamacpp", "b10798", server.base_url
    vllm = request.getfixturevalue("vllm_server")
    return "vllm", "0.31.0", vllm.base_url


async def _serve(kind: str, version: str, url: str) -> AsyncIterator[RunningGateway]:
    deployment = {
        "name": "my-model",
        "engine": kind,
        "engine_version": version,
        "served_model": "tiny",
        "instances": [{"url": url}],
    }
    async for gateway in serve_gateway({"deployments": [deployment]}):
        yield gateway


@pytest.fixture
async def gw(target: tuple[str, str, str]) -> AsyncIterator[RunningGateway]:
    async for gateway in _serve(*target):
        yield gateway


@pytest.fixture
async def llama_gw(llama_server: LlamaServer) -> AsyncIterator[RunningGateway]:
    async for gateway in _serve("llamacpp", "b10798", llama_server.base_url):
        yield gateway


def client(gw: RunningGateway) -> anthropic.AsyncAnthropic:
    headers = {"anthropic-beta": BETAS}
    return anthropic.AsyncAnthropic(
        base_url=gw.url, api_key=gw.key, max_retries=0, timeout=120, default_headers=headers
    )


async def _raw(gw: RunningGateway, body: dict[str, Any]) -> httpx.Response:
    """The gateway's bytes for ``body``, as Claude Code sends it (``x-api-key``, its betas)."""
    headers = {"x-api-key": gw.key, "anthropic-version": "2023-06-01", "anthropic-beta": BETAS}
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(gw.url + "/v1/messages?beta=true", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r


async def test_plain_text_whole_and_streamed(gw: RunningGateway) -> None:
    body: dict[str, Any] = {"model": "my-model", "max_tokens": 8, "system": SYSTEM}
    body["messages"] = [{"role": "user", "content": "Hello"}]
    whole = await _raw(gw, body)
    message = validate_message(whole.json())
    assert message.model == "my-model" and message.content[0].type == "text"
    assert message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.output_tokens <= 8 and message.usage.input_tokens > 0
    assert "ttft_ms" in whole.headers["X-CapyCTL-Metrics"]
    events, comments = sse_events((await _raw(gw, {**body, "stream": True})).text)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-1] == "message_stop"
    assert comments and comments[0].startswith(": x-capyctl-metrics ")
    async with client(gw) as c, c.messages.stream(**body) as helper:
        final = await helper.get_final_message()
    assert final.content[0].type == "text" and final.usage.output_tokens <= 8


async def test_count_tokens_is_the_engines_own_count_of_the_prompt(gw: RunningGateway) -> None:
    """The count of a prompt is the input the engine reports answering it: the same prompt,
    rendered and tokenized by the engine itself."""
    ask: dict[str, Any] = {"model": "my-model", "system": SYSTEM, "tools": [WEATHER]}
    ask["messages"] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    async with client(gw) as c:
        counted = await c.messages.count_tokens(**ask)
        raw = await c.messages.with_raw_response.count_tokens(**ask)
        answered = await c.messages.create(**ask, max_tokens=2, tool_choice={"type": "none"})
    validate_count(raw.http_response.json())
    used = answered.usage
    assert counted.input_tokens == used.input_tokens + (used.cache_read_input_tokens or 0)


async def test_a_tool_use_round_trip(gw: RunningGateway, target: tuple[str, str, str]) -> None:
    """vLLM makes the call (a named tool_choice constrains it); llama-server b10798 does not
    constrain a call for the tiny model's template, so there the call is the client's, as a
    client replays an earlier turn. Its tool_result goes back; the answer is text."""
    question: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]
    async with client(gw) as c:
        if target[0] == "vllm":
            first = await c.messages.create(
                model="my-model",
                max_tokens=48,
                messages=question,
                tools=[WEATHER],
                tool_choice={"type": "tool", "name": "weather"},
            )
            uses = [b for b in first.content if b.type == "tool_use"]
            assert uses and first.stop_reason == "tool_use", first
            assert uses[0].name == "weather" and isinstance(uses[0].input["city"], str)
            turn: Any = first.to_param()
            use_id = uses[0].id
        else:
            use_id = "toolu_1"
            call = {"type": "tool_use", "id": use_id, "name": "weather", "input": {"city": "Oslo"}}
            turn = {"role": "assistant", "content": [call]}
        result: Any = {"type": "tool_result", "tool_use_id": use_id, "content": "Sunny, 21 C"}
        final = await c.messages.create(
            model="my-model",
            max_tokens=8,
            messages=[*question, turn, {"role": "user", "content": [result]}],
            tools=[WEATHER],
        )
    assert final.content and final.content[0].type == "text"


async def test_a_claude_code_shaped_conversation(llama_gw: RunningGateway) -> None:
    """Several turns as Claude Code sends them to llama-server: system blocks (its billing line
    among them), tools, metadata, streamed with its betas and ``?beta=true``; each answer sent
    back as the next turn's assistant message; a tool_use answered by a tool_result (an error
    one too); every event and the final Message held to the SDK's types."""
    history: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "List files"}]}]
    body: dict[str, Any] = {"model": "my-model", "max_tokens": 12, "system": SYSTEM}
    body |= {"tools": [WEATHER], "metadata": {"user_id": "user_1_session_2"}, "stream": True}
    for turn in range(3):
        events, _ = sse_events((await _raw(llama_gw, {**body, "messages": history})).text)
        assert events[-1]["type"] == "message_stop", events[-1]
        text = "".join(e["delta"].get("text", "") for e in events if "delta" in e)
        reply: list[Any] = [{"type": "text", "text": text}] if text else []
        use_id = f"toolu_{turn}"
        reply.append(
            {"type": "tool_use", "id": use_id, "name": "weather", "input": {"city": "Oslo"}}
        )
        history.append({"role": "assistant", "content": reply})
        result: Any = {"type": "tool_result", "tool_use_id": use_id, "content": "sunny"}
        if turn == 1:
            result |= {"is_error": True, "content": [{"type": "text", "text": "no network"}]}
        history.append({"role": "user", "content": [result, {"type": "text", "text": "Go on"}]})
    async with (
        client(llama_gw) as c,
        c.messages.stream(
            **{k: v for k, v in body.items() if k != "stream"}, messages=history
        ) as helper,
    ):
        final = await helper.get_final_message()
    assert final.content[0].type == "text" and final.usage.input_tokens > 0


async def test_a_hang_up_closes_the_engine_connection(
    llama_gw: RunningGateway, llama_server: LlamaServer
) -> None:
    """Two long streamed Messages, both clients gone once the engine runs both: llama-server
    reports idle again at once."""
    body = {"model": "my-model", "max_tokens": 30000, "stream": True}
    body["messages"] = [{"role": "user", "content": "Hello"}]
    assert await both_hang_up(llama_gw, llama_server, "/v1/messages", body) < 1.0


async def test_an_engine_fault_mid_stream_is_an_error_event(cut_gateway: RunningGateway) -> None:
    body = {"model": "my-model", "max_tokens": 2000, "stream": True}
    body["messages"] = [{"role": "user", "content": "Hello"}]
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(
            cut_gateway.url + "/v1/messages", json=body, headers={"x-api-key": cut_gateway.key}
        )
    events, comments = sse_events(r.text)
    kinds = [e["type"] for e in events]
    assert "content_block_delta" in kinds  # it had started answering
    assert kinds[-1] == "error" and not comments
    assert events[-1]["error"]["message"].startswith("engine_error: ")
