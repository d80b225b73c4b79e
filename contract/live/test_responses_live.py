"""``/v1/responses`` through the gateway to a real llama-server and a real vLLM (CPU), driven
by the official ``openai`` client: every Response and event it gets is also held to OpenAI's
own schemas.

The models are tiny and random: what they say means nothing, so a tool call is asked for by
``tool_choice`` (the engine then constrains its output to the call) and structured output by
a JSON schema, and each is judged by its shape."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from openai import AsyncOpenAI
from tests.gateway.openai_schemas import validate_event, validate_response

from contract.conftest import RunningGateway, serve_gateway
from contract.engines.llamacpp import LlamaServer
from contract.engines.vllm import VllmServer
from contract.live.test_gateway_llamacpp_live import both_hang_up

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

WEATHER: Any = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
SCHEMA = {"type": "integer", "minimum": 0, "maximum": 9}
"""A digit: a schema with no room between tokens (the random models fill an object's room
for whitespace until their token limit)."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["llamacpp", "vllm"])
def target(request: pytest.FixtureRequest) -> tuple[str, str, str]:
    """The engine a test's gateway is in front of: kind, version, base URL."""
    if request.param == "llamacpp":
        server: LlamaServer = request.getfixturevalue("llama_server")
        return "llamacpp", "b10798", server.base_url
    vllm: VllmServer = request.getfixturevalue("vllm_server")
    return "vllm", "0.31.0", vllm.base_url


@pytest.fixture
async def gw(target: tuple[str, str, str]) -> AsyncIterator[RunningGateway]:
    kind, version, url = target
    deployment = {
        "name": "my-model",
        "engine": kind,
        "engine_version": version,
        "served_model": "tiny",
        "instances": [{"url": url}],
    }
    async for gateway in serve_gateway({"deployments": [deployment]}):
        yield gateway


def client(gw: RunningGateway) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.url + "/v1", api_key=gw.key, max_retries=0, timeout=120)


def _valid(response: Any) -> dict[str, Any]:
    wire: dict[str, Any] = response.model_dump(mode="json", exclude_unset=True, by_alias=True)
    validate_response(wire)
    return wire


async def test_plain_text_whole_and_streamed(gw: RunningGateway) -> None:
    async with client(gw) as c:
        whole = await c.responses.create(model="my-model", input="Hello", max_output_tokens=8)
        stream = await c.responses.create(
            model="my-model", input="Hello", max_output_tokens=8, stream=True
        )
        events = [
            ev.model_dump(mode="json", exclude_unset=True, by_alias=True) async for ev in stream
        ]
    wire = _valid(whole)
    assert whole.model == "my-model" and whole.output_text
    assert whole.status == "incomplete"  # 8 tokens: the random model never stops by itself
    assert whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage is not None and whole.usage.output_tokens == 8
    assert "ttft_ms" in wire["capyctl"]["metrics"]
    for ev in events:
        validate_event(ev)
    assert [ev["sequence_number"] for ev in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete"
    deltas = "".join(ev["delta"] for ev in events if ev["type"] == "response.output_text.delta")
    assert deltas == events[-1]["response"]["output"][0]["content"][0]["text"]


async def test_what_a_coding_agent_sends_with_every_turn(gw: RunningGateway) -> None:
    """Codex's fields on every turn (include of encrypted reasoning, a prompt cache key,
    store false, truncation disabled) reach a real engine, streamed, and come back echoed."""
    async with client(gw) as c:
        stream = await c.responses.create(
            model="my-model",
            instructions="You are a coding agent.",
            input="Hello",
            max_output_tokens=8,
            stream=True,
            store=False,
            include=["reasoning.encrypted_content"],
            prompt_cache_key="session-1",
            truncation="disabled",
        )
        events = [
            ev.model_dump(mode="json", exclude_unset=True, by_alias=True) async for ev in stream
        ]
    for ev in events:
        validate_event(ev)
    done = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and done["output"][0]["content"][0]["text"]
    assert done["prompt_cache_key"] == "session-1" and done["store"] is False


@pytest.mark.parametrize("stream", [False, True])
async def test_logprobs_included_are_the_engines_own(gw: RunningGateway, stream: bool) -> None:
    """``include`` of the text's logprobs, with two alternatives a token: the engine's own, one
    a generated token (the 8 the limit allows), each with its two alternatives, in OpenAI's
    shape; streamed, the delta events carry them all between them."""
    ask: dict[str, Any] = {"model": "my-model", "input": "Hello", "max_output_tokens": 8}
    ask |= {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    async with client(gw) as c:
        if stream:
            events = [
                ev.model_dump(mode="json", exclude_unset=True, by_alias=True)
                async for ev in await c.responses.create(**ask, stream=True)
            ]
            for ev in events:
                validate_event(ev)
            done = events[-1]["response"]
            deltas = [ev for ev in events if ev["type"] == "response.output_text.delta"]
            along = [t for ev in deltas for t in ev["logprobs"]]
        else:
            done = _valid(await c.responses.create(**ask))
    part = done["output"][0]["content"][0]
    tokens = part["logprobs"]
    assert done["top_logprobs"] == 2 and len(tokens) == 8, tokens
    for t in tokens:
        assert t["logprob"] <= 0 and isinstance(t["token"], str)
        assert len(t["top_logprobs"]) == 2 and all(a["logprob"] <= 0 for a in t["top_logprobs"])
        if "\ufffd" not in t["token"]:  # a whole piece of text: its bytes are its own
            assert bytes(t["bytes"]) == t["token"].encode()
    if stream:
        assert along == tokens


async def test_a_function_call_round_trip(gw: RunningGateway, target: tuple[str, str, str]) -> None:
    """The model calls the tool (vLLM: made to, by a named tool_choice), its output goes back,
    the final answer is text. llama-server b10798 does not constrain a call for a template
    without tools (the tiny model's ChatML), so there the call is the client's, as a client
    replays an earlier turn, and the engine answers the conversation with its output."""
    async with client(gw) as c:
        question: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
        if target[0] == "vllm":
            first = await c.responses.create(
                model="my-model",
                input=question,
                tools=[WEATHER],
                tool_choice={"type": "function", "name": "weather"},
                max_output_tokens=48,
            )
            _valid(first)
            calls = [item for item in first.output if item.type == "function_call"]
            assert calls, first.output
            call = calls[0]
            assert call.name == "weather" and call.call_id
            assert isinstance(json.loads(call.arguments)["city"], str)
            turn = [item.model_dump(exclude_unset=True, by_alias=True) for item in first.output]
            call_id = call.call_id
        else:
            call_id = "call_1"
            turn = [
                {
                    "type": "function_call",
                    "call_id": call_id,
                    "name": "weather",
                    "arguments": '{"city": "Oslo"}',
                }
            ]
        follow = [
            *question,
            *turn,
            {"type": "function_call_output", "call_id": call_id, "output": "Sunny, 21 C"},
        ]
        final = await c.responses.create(
            model="my-model",
            input=follow,
            tools=[WEATHER],
            tool_choice="none",
            max_output_tokens=8,
        )
    _valid(final)
    assert final.output_text
    assert not [item for item in final.output if item.type == "function_call"]


async def test_structured_output(gw: RunningGateway) -> None:
    async with client(gw) as c:
        reply = await c.responses.create(
            model="my-model",
            input="Pick a digit.",
            text={"format": {"type": "json_schema", "name": "digit", "schema": SCHEMA}},
            max_output_tokens=16,
        )
    wire = _valid(reply)
    assert wire["text"]["format"]["name"] == "digit"
    assert reply.status == "completed", wire
    assert 0 <= json.loads(reply.output_text) <= 9


async def test_a_hang_up_closes_the_engine_connection(
    llama_gateway: RunningGateway, llama_server: LlamaServer
) -> None:
    """Two long streamed responses, both clients gone once the engine runs both: llama-server
    reports idle again at once."""
    body = {"model": "my-model", "input": "Hello", "max_output_tokens": 30000, "stream": True}
    assert await both_hang_up(llama_gateway, llama_server, "/v1/responses", body) < 1.0


class _Cutter:
    """A TCP relay to the real engine that closes both sides once ``after`` bytes of the
    engine's answer have passed: the engine's stream breaks mid-answer.

    Every connection is registered the moment it is accepted (the accept callback is plain,
    not a coroutine, so it runs inside ``connection_made``) and every task it starts is owned
    here: on exit the tasks are cancelled and awaited and every transport aborted, those of
    relays that never got to run included. None is left for the collector to find after the
    loop has closed."""

    def __init__(self, target: tuple[str, int], after: int) -> None:
        self.target, self.after = target, after
        self.port = 0
        self.relays: set[asyncio.Task[None]] = set()
        self.writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> _Cutter:
        self.server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for task in self.relays:
            task.cancel()
        await asyncio.gather(*self.relays, return_exceptions=True)
        for writer in self.writers:
            writer.transport.abort()
        for writer in self.writers:
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await self.server.wait_closed()

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        self.relays.add(asyncio.create_task(self._relay(reader, writer)))

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(*self.target)
        self.writers.add(up_w)

        async def up() -> None:
            while data := await reader.read(65536):
                up_w.write(data)

        task = asyncio.create_task(up())
        try:
            passed = 0
            while passed < self.after and (data := await up_r.read(256)):
                writer.write(data)
                passed += len(data)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            up_w.transport.abort()
            writer.transport.abort()


@pytest.fixture
async def cut_gateway(llama_server: LlamaServer) -> AsyncIterator[RunningGateway]:
    host, port = llama_server.base_url.removeprefix("http://").split(":")
    async with _Cutter((host, int(port)), after=3000) as cutter:
        deployment = {
            "name": "my-model",
            "engine": "llamacpp",
            "engine_version": "b10798",
            "served_model": "tiny",
            "instances": [{"url": f"http://127.0.0.1:{cutter.port}"}],
        }
        async for gw in serve_gateway({"deployments": [deployment]}):
            yield gw


async def test_an_engine_fault_mid_stream_is_response_failed(cut_gateway: RunningGateway) -> None:
    body = {"model": "my-model", "input": "Hello", "max_output_tokens": 2000, "stream": True}
    headers = {"Authorization": f"Bearer {cut_gateway.key}"}
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(cut_gateway.url + "/v1/responses", json=body, headers=headers)
    events = [orjson.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: ")]
    for ev in events:
        validate_event(ev)
    kinds = [ev["type"] for ev in events]
    assert "response.output_text.delta" in kinds  # it had started answering
    assert kinds[-2:] == ["error", "response.failed"]
    assert events[-2]["code"] == "engine_error"
    assert events[-1]["response"]["error"]["message"].startswith("engine_error: ")
