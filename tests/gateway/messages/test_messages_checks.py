"""The Messages API's refusals, each in Anthropic's shape and status and none reaching an
engine; its bounds; and ``count_tokens`` by the engine's own tokenizer, with one process and
with two workers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import anyio
import httpx
import pytest

from tests.eventually import eventually
from tests.gateway.anthropic_types import (
    sse_events,
    validate_count,
    validate_error,
    validate_message,
)
from tests.gateway.conftest import WORKERS, Gw, deployments
from tests.gateway.fake_engine import FakeEngine, Gate, Hold, Reply, template_of
from tests.gateway.messages.test_messages import HELLO, WEATHER, ask, script

pytestmark = pytest.mark.anyio
workers = WORKERS
MakeGateway = Callable[..., Awaitable[Gw]]
IMAGE = {"type": "image", "source": {"type": "file", "file_id": "f_1"}}


@pytest.fixture
async def gateway(engine: FakeEngine, make_gateway: MakeGateway) -> Gw:
    return await make_gateway(
        {
            "deployments": [
                deployments(engine.url),
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


def user(*blocks: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(blocks)}]


BAD = "invalid_request_error"
REFUSALS: list[tuple[dict[str, Any], int, str, str]] = [
    ({"max_tokens": None}, 400, BAD, "max_tokens is required"),
    ({"max_tokens": 0}, 400, BAD, "max_tokens"),
    ({"messages": []}, 400, BAD, "messages is required"),
    ({"best_of": 2}, 400, BAD, "`best_of` is not accepted"),
    ({"messages": [*HELLO, {"role": "assistant", "content": "The"}]}, 400, BAD, "prefill"),
    ({"messages": user({"type": "document", "source": {}})}, 400, BAD, "'document'"),
    ({"messages": user(IMAGE)}, 400, BAD, "file_id"),
    (
        {"messages": user({"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]})},
        400,
        BAD,
        "text only",
    ),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, BAD, "no tools"),
    ({"tools": [{**WEATHER, "input_examples": [{"city": "Oslo"}]}]}, 400, BAD, "input_examples"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, 400, BAD, "tool search"),
    ({"tool_choice": {"type": "any"}}, 400, BAD, "needs tools"),
    ({"tool_choice": {"type": "tool", "name": "x"}, "tools": [WEATHER]}, 400, BAD, "'x'"),
    ({"temperature": 1.5}, 400, BAD, "temperature"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, 400, BAD, "reasoning"),
    ({"model": "llama", "stop_sequences": ["END"]}, 400, BAD, "stop_sequences"),
    (
        {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
        400,
        BAD,
        "clear_tool_uses",
    ),
    ({"container": "c_1"}, 400, BAD, "container"),
    ({"mcp_servers": [{"type": "url", "url": "u", "name": "n"}]}, 400, BAD, "mcp_servers"),
    ({"model": "decider"}, 400, BAD, "POST /v1/systemone"),
    ({"model": "nope"}, 404, "not_found_error", "unknown_model"),
    ({"model": "llama", "cache_salt": "s"}, 400, BAD, "cache_salt_unsupported"),
]


@pytest.mark.parametrize(("over", "status", "kind", "words"), REFUSALS)
async def test_refusals_are_anthropics_shape_and_never_reach_an_engine(
    gateway: Gw, engine: FakeEngine, over: dict[str, Any], status: int, kind: str, words: str
) -> None:
    body = {k: v for k, v in ask(**over).items() if v is not None}
    async with gateway.client() as c:
        r = await c.post("/v1/messages", json=body)
    assert r.status_code == status, r.text
    error = validate_error(r.json())
    assert error.error.type == kind and words in error.error.message
    assert error.request_id == r.headers["X-CapyCTL-Request-Id"]
    assert engine.received == []


@pytest.mark.parametrize(
    ("headers", "words"),
    [
        ({"anthropic-beta": "claude-code-20250219,files-api-2025-04-14"}, "files-api-2025-04-14"),
        ({"anthropic-beta": "mcp-client-2025-04-04"}, "mcp-client-2025-04-04"),
        ({"anthropic-version": "2023-01-01"}, "2023-01-01"),
    ],
)
async def test_a_beta_or_version_not_served_is_refused_by_name(
    gateway: Gw, engine: FakeEngine, headers: dict[str, str], words: str
) -> None:
    async with gateway.client() as c:
        r = await c.post("/v1/messages", json=ask(), headers=headers)
        counted = await c.post("/v1/messages/count_tokens", json={"model": "my-model",
                                                                   "messages": HELLO},
                               headers=headers)  # fmt: skip
    for got in (r, counted):
        assert got.status_code == 400, got.text
        assert words in validate_error(got.json()).error.message
    assert engine.received == []


async def test_a_stream_hears_of_a_refusal_in_band(gateway: Gw, engine: FakeEngine) -> None:
    """``cache_salt`` for an engine that ignores it, asked with a stream: one error event."""
    async with gateway.client() as c:
        r = await c.post("/v1/messages", json=ask(model="llama", cache_salt="s", stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events, comments = sse_events(r.text)
    assert [e["type"] for e in events] == ["error"] and comments == []
    assert events[0]["error"]["message"].startswith("cache_salt_unsupported: ")
    assert engine.received == []


async def test_a_wrong_method_and_an_engine_failure(gateway: Gw, engine: FakeEngine) -> None:
    engine.script = Reply(status=500, body=b"boom")
    async with gateway.client() as c:
        got = await c.get("/v1/messages")
        failed = await c.post("/v1/messages", json=ask())
        streamed = await c.post("/v1/messages", json=ask(stream=True))
    assert got.status_code == 405 and got.headers["Allow"] == "POST"
    assert validate_error(got.json()).error.type == "invalid_request_error"
    for r in (failed, streamed):  # nothing was written: an HTTP error, as on chat
        assert r.status_code == 502
        error = validate_error(r.json()).error
        assert error.type == "api_error" and error.message.startswith("engine_error: ")


async def test_a_body_past_its_bound_is_request_too_large(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway(
        {"limits": {"max_body_bytes": 4096}, "deployments": [deployments(engine.url)]}
    )
    async with gw.client() as c:
        r = await c.post("/v1/messages", json=ask(system="x" * 5000))
    assert r.status_code == 413
    validate_error(r.json())
    assert r.json()["error"]["type"] == "request_too_large"


async def test_a_full_queue_is_rate_limit_error_and_a_deadline_overloaded_error(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    """The gateway's 429 is Anthropic's rate_limit_error (Retry-After kept); its 503 (a
    deadline passed waiting) is 529 overloaded_error, which Anthropic's clients retry."""
    gw = await make_gateway(
        {
            "queue": {
                "max_running_per_deployment": 1,
                "max_waiting_per_deployment": 1,
                "request_deadline": "1s",
            },
            "deployments": [deployments(engine.url)],
        }
    )
    engine.script = [Hold()]
    route = gw.gateway.fleet.routes["my-model"]
    got: list[httpx.Response] = []

    async def send() -> None:
        got.append(await c.post("/v1/messages", json=ask()))

    async with gw.client() as c, anyio.create_task_group() as tg:
        tg.start_soon(send)  # it holds the one running slot
        with anyio.fail_after(5):
            await engine.arrived.wait()
        tg.start_soon(send)
        await eventually(lambda: route.queue.waiting == 1)  # it took the one waiting place
        full = await c.post("/v1/messages", json=ask())
        await eventually(lambda: len(got) == 2)  # both past the deadline: 503, so 529
    assert full.status_code == 429 and full.headers["Retry-After"] == "1"
    assert validate_error(full.json()).error.type == "rate_limit_error"
    for late in got:  # the running one's output never came; the waiter never ran
        assert late.status_code == 529
        assert validate_error(late.json()).error.type == "overloaded_error"


@pytest.mark.parametrize("stream", [False, True])
async def test_the_answer_bound_counts_blocks_and_deltas(
    engine: FakeEngine, make_gateway: MakeGateway, stream: bool
) -> None:
    """One-byte thinking and text in turn each begin a block: at one byte each, a 16 KiB bound
    would let 16,384 blocks through. Each block and delta counts (256 and 128 bytes beyond its
    text), so what a stream sends stays within twice the bound, and a whole Message fails."""
    bound = 16 * 1024
    gw = await make_gateway(
        {
            "limits": {"max_answer_bytes": bound},
            "deployments": [deployments(engine.url, reasoning=True)],
        }
    )
    gate = Gate(asyncio.Event())
    turns = script(*[{"reasoning" if i % 2 else "content": "a"} for i in range(5000)])
    engine.script = [*turns[:2], gate, *turns[2:]]
    received = b""
    if not stream:
        gate.opened.set()  # a whole answer's head waits for its end
    async with gw.client() as c, c.stream("POST", "/v1/messages", json=ask(stream=stream)) as r:
        async for part in r.aiter_bytes():
            received += part
            if b"text_delta" in received:
                gate.opened.set()
    if not stream:
        assert r.status_code == 502 and f"over {bound} bytes".encode() in received
        return
    assert len(received) <= 2 * bound, len(received)
    events, _ = sse_events(received.decode())
    assert events[-1]["type"] == "error" and f"over {bound} bytes" in events[-1]["error"]["message"]


async def test_count_tokens_by_the_engines_own_tokenizer(gateway: Gw, engine: FakeEngine) -> None:
    """vLLM: its /tokenize of the chat messages and tools; llama.cpp: its /apply-template, then
    its /tokenize of that prompt with its special tokens. What each is sent is the prompt a
    Messages request would be (the billing line left out, the tools as chat's)."""
    body: Any = {
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                   {"type": "text", "text": "Be brief."}],
        "messages": HELLO,
        "tools": [WEATHER],
    }  # fmt: skip
    prompt = template_of(
        {
            "messages": [{"role": "system", "content": "Be brief."}, *HELLO],
            "tools": [{"function": {"name": "weather"}}],
        }
    )
    async with anthropic.AsyncAnthropic(
        base_url=gateway.url, api_key=gateway.key, max_retries=0
    ) as client:
        for model in ("my-model", "llama"):
            engine.received.clear()
            counted = await client.messages.count_tokens(model=model, **body)
            assert counted.input_tokens == len(prompt)
            got = [r.body for r in engine.received]
            if model == "my-model":
                ((vllm),) = got
                assert vllm["path"] == "/tokenize" and vllm["model"] == "tiny"
                assert vllm["add_generation_prompt"] is True and "stream" not in vllm
                assert vllm["messages"][0] == {"role": "system", "content": "Be brief."}
            else:
                template, tokenize = got
                assert template["path"] == "/apply-template" and "stream" not in template
                assert tokenize == {"path": "/tokenize", "content": prompt, "add_special": True}
    async with gateway.client() as c:
        raw = await c.post("/v1/messages/count_tokens", json={"model": "llama", **body})
        validate_count(raw.json())


@pytest.mark.parametrize(
    ("model", "reply", "status", "words"),
    [
        ("tf", None, 400, "not served for tensorfold"),
        ("decider", None, 400, "api_mismatch"),
        ("my-model", Reply(400, b'{"error": {"message": "too long", "code": 400}}'), 400, "too"),
        ("my-model", Reply(200, b'{"tokens": []}'), 502, "no count"),
    ],
)
async def test_count_tokens_refusals(
    gateway: Gw, engine: FakeEngine, model: str, reply: Reply | None, status: int, words: str
) -> None:
    engine.tokenizer = reply
    async with gateway.client() as c:
        r = await c.post("/v1/messages/count_tokens", json={"model": model, "messages": HELLO})
    assert r.status_code == status, r.text
    assert words in validate_error(r.json()).error.message


async def test_a_message_with_an_image_reaches_the_engine_as_chats(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = script({"content": "a cat"})
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    text = {"type": "text", "text": "What is it?"}
    async with gateway.client() as c:
        r = await c.post("/v1/messages", json=ask(messages=user(image, url, text)))
    validate_message(r.json())
    assert engine.received[-1].body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                {"type": "text", "text": "What is it?"},
            ],
        }
    ]
