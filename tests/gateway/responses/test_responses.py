"""``POST /v1/responses`` against the fake engine: what the engine is asked, what the client
gets, each held to OpenAI's own schemas (``openai_schemas``), with one process and with two
workers."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import httpx
import orjson
import pytest
from anyio import to_thread
from openai import AsyncOpenAI, OpenAI

from tests.eventually import eventually
from tests.gateway.conftest import WORKERS, Gw, deployments
from tests.gateway.fake_engine import DONE, FakeEngine, Gate, Hold, Reply, chunk, event
from tests.gateway.management.test_metrics import samples, scrape
from tests.gateway.openai_schemas import validate_event, validate_response

pytestmark = pytest.mark.anyio
workers = WORKERS

USAGE = {
    "prompt_tokens": 7,
    "completion_tokens": 5,
    "total_tokens": 12,
    "prompt_tokens_details": {"cached_tokens": 4},
}
CALL = {"index": 0, "id": "call_9", "type": "function", "function": {"name": "weather"}}


def _script(*deltas: dict[str, Any], finish: str = "stop", usage: Any = USAGE) -> list[bytes]:
    items = [event(chunk(delta={"role": "assistant", "content": ""}))]
    items += [event(chunk(delta=d)) for d in deltas]
    items.append(event(chunk(delta={}, finish=finish)))
    if usage is not None:
        items.append(event(chunk(choices=[], usage=usage)))
    return [*items, DONE]


MIXED = _script(
    {"reasoning": "Think"},
    {"reasoning": "ing."},
    {"content": "Let me "},
    {"content": "look."},
    {"tool_calls": [{**CALL, "function": {"name": "weather", "arguments": '{"city"'}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]},
    {"tool_calls": [{"index": 1, "id": "call_10", "function": {"name": "time"}}]},
    {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
    finish="tool_calls",
)


def events_of(text: str) -> tuple[list[dict[str, Any]], list[str]]:
    """A Responses stream's events (each validated), and its comment lines."""
    events, comments = [], []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        data = [line[6:] for line in lines if line.startswith("data: ")]
        comments += [line for line in lines if line.startswith(":")]
        if data:
            (payload,) = data
            ev = orjson.loads(payload)
            names = [line[7:] for line in lines if line.startswith("event: ")]
            assert names == [ev["type"]]
            validate_event(ev)
            events.append(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events, comments


async def test_a_whole_response_is_openais_shape_with_our_figures(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = MIXED
    async with gateway.client() as c:
        r = await c.post(
            "/v1/responses",
            json={"model": "my-model", "input": "Weather?", "metadata": {"t": "1"}},
            headers={"X-Request-Id": "caller-1"},
        )
    assert r.status_code == 200, r.text
    assert r.headers["X-Request-Id"] == "caller-1" and len(r.headers["X-CapyCTL-Request-Id"]) == 26
    body = r.json()
    validate_response(body)
    assert body["status"] == "completed" and body["model"] == "my-model"
    assert body["metadata"] == {"t": "1"} and body["store"] is False
    reasoning, message, first, second = body["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert message["content"][0]["text"] == "Let me look."
    assert (first["call_id"], first["name"], first["arguments"]) == (
        "call_9",
        "weather",
        '{"city": "Oslo"}',
    )
    assert (second["call_id"], second["name"], second["arguments"]) == ("call_10", "time", "{}")
    assert "usage" not in body  # it reasoned, and the engine did not count those tokens
    assert "ttft_ms" in body["capyctl"]["metrics"]
    sent = engine.received[-1].body
    assert sent["model"] == "tiny" and sent["stream"] is True
    assert sent["messages"] == [{"role": "user", "content": "Weather?"}]
    assert sent["stream_options"] == {"include_usage": True}
    assert "metadata" not in sent  # echoed, not the engine's


@pytest.mark.parametrize(
    ("deltas", "usage", "reasoning"),
    [
        ([{"content": "ok"}], USAGE, 0),  # no reasoning streamed: none counted, exactly
        (
            [{"reasoning": "hm"}, {"content": "ok"}],
            {**USAGE, "completion_tokens_details": {"reasoning_tokens": 2}},
            2,
        ),
    ],
)
async def test_usage_is_the_engines_counts(
    gateway: Gw, engine: FakeEngine, deltas: list[Any], usage: Any, reasoning: int
) -> None:
    engine.script = _script(*deltas, usage=usage)
    async with gateway.client() as c:
        body = (await c.post("/v1/responses", json={"model": "my-model", "input": "x"})).json()
    validate_response(body)
    assert body["usage"] == {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": 12,
    }


@pytest.mark.parametrize(
    "usage",
    [None, {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}],
    ids=["none", "no-cached-count"],
)
async def test_usage_not_counted_is_left_out(gateway: Gw, engine: FakeEngine, usage: Any) -> None:
    engine.script = _script({"content": "ok"}, usage=usage)
    async with gateway.client() as c:
        body = (await c.post("/v1/responses", json={"model": "my-model", "input": "x"})).json()
    validate_response(body)
    assert "usage" not in body


async def test_a_stream_is_openais_events_in_order_with_the_figures_before_its_end(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = MIXED
    async with gateway.client() as c:
        r = await c.post(
            "/v1/responses", json={"model": "my-model", "input": "Weather?", "stream": True}
        )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events, comments = events_of(r.text)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == 4
    assert kinds.count("response.output_item.done") == 4
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "Let me look."
    args = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(args) == '{"city": "Oslo"}{}'
    done = events[-1]["response"]
    assert [item["type"] for item in done["output"]] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    (comment,) = comments
    assert comment.startswith(": x-capyctl-metrics ")
    assert r.text.index("response.completed") < r.text.index("x-capyctl-metrics")
    assert "ttft_ms" in orjson.loads(comment.removeprefix(": x-capyctl-metrics "))


async def test_a_length_finish_is_an_incomplete_response(gateway: Gw, engine: FakeEngine) -> None:
    engine.script = _script({"content": "cut"}, finish="length")
    async with gateway.client() as c:
        whole = (await c.post("/v1/responses", json={"model": "my-model", "input": "x"})).json()
        streamed = await c.post(
            "/v1/responses", json={"model": "my-model", "input": "x", "stream": True}
        )
    validate_response(whole)
    assert whole["status"] == "incomplete"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["output"][0]["status"] == "incomplete"
    events, _ = events_of(streamed.text)
    assert events[-1]["type"] == "response.incomplete"


async def test_a_fault_mid_stream_is_response_failed_with_our_code_and_closes_the_engine(
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
    body = {"model": "my-model", "input": "x", "stream": True}
    text = ""
    async with gateway.client() as c, c.stream("POST", "/v1/responses", json=body) as r:
        async for part in r.aiter_text():
            text += part
            if "response.output_text.delta" in text:
                gate.opened.set()  # the text was relayed: now the fault
        with anyio.fail_after(5):
            await engine.hung_up.wait()  # the gateway closed the engine's connection
    events, comments = events_of(text)
    error, failed = events[-2:]
    assert error["type"] == "error" and error["code"] == "stream_unverified"
    assert failed["type"] == "response.failed"
    response = failed["response"]
    assert response["status"] == "failed" and response["error"]["code"] == "server_error"
    assert response["error"]["message"].startswith("stream_unverified: ")
    assert response["output"][0]["status"] == "incomplete"
    assert response["output"][0]["content"][0]["text"] == "Hel"
    assert not comments  # no figures for an answer that failed


async def test_a_fault_before_any_output(gateway: Gw, engine: FakeEngine) -> None:
    """An engine error before anything was written is an HTTP error; a chunk that fails
    verification is told in band to a stream, as on chat."""
    engine.script = Reply(status=500, body=b"boom")
    async with gateway.client() as c:
        for stream in (False, True):
            r = await c.post(
                "/v1/responses", json={"model": "my-model", "input": "x", "stream": stream}
            )
            assert r.status_code == 502, r.text
            assert r.json()["code"] == "engine_error"
        engine.script = [event(chunk(delta={"invented": "x"})), DONE]
        whole = await c.post("/v1/responses", json={"model": "my-model", "input": "x"})
        streamed = await c.post(
            "/v1/responses", json={"model": "my-model", "input": "x", "stream": True}
        )
    assert whole.status_code == 502 and whole.json()["code"] == "engine_error"
    events, _ = events_of(streamed.text)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "error",
        "response.failed",
    ]


async def test_the_request_becomes_the_engines_chat_request(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = _script({"content": "ok"})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {
        "model": "my-model",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "parallel_tool_calls": False,
        "max_output_tokens": 9,
        "temperature": 0.5,
        "top_p": 1,
        "text": {"format": {"type": "json_schema", "name": "out", "schema": schema}},
        "reasoning": {"effort": "low"},
        "cache_salt": "tenant-1",
        "store": True,
    }
    async with gateway.client() as c:
        r = await c.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    validate_response(answer)
    assert answer["store"] is False  # it asked, and is told the truth
    assert answer["tool_choice"] == {"type": "function", "name": "f"}
    assert answer["instructions"] == "Be brief." and answer["max_output_tokens"] == 9
    sent = engine.received[-1].body
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    assert sent["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert sent["parallel_tool_calls"] is False and sent["max_tokens"] == 9
    assert (sent["temperature"], sent["top_p"]) == (0.5, 1.0)
    assert sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": schema},
    }
    assert sent["reasoning_effort"] == "low" and sent["cache_salt"] == "tenant-1"


async def test_what_a_coding_agent_sends_with_every_turn_is_taken(
    gateway: Gw, engine: FakeEngine
) -> None:
    """A request shaped as Codex's: ``include`` of encrypted reasoning, ``prompt_cache_key``,
    ``store: false``, ``parallel_tool_calls``, a reasoning item sent back with its encrypted
    content (refused, the first three made every such request a 400). The key and ``user``
    are echoed; ``user`` reaches the engine as chat's; the reasoning item does not."""
    engine.script = _script({"content": "ok"})
    body = {
        "model": "my-model",
        "instructions": "You are a coding agent.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "b"}]},
        ],
        "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": None,
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0193a5c4-session",
        "truncation": "disabled",
        "user": "dev-7",
    }
    async with gateway.client() as c:
        r = await c.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    events, _ = events_of(r.text)
    done = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert done["prompt_cache_key"] == "0193a5c4-session" and done["user"] == "dev-7"
    assert done["output"][0]["content"][0]["text"] == "ok"
    sent = engine.received[-1].body
    assert sent["user"] == "dev-7" and "prompt_cache_key" not in sent and "include" not in sent
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "user"]


def _lp(token: str, value: float, *, top: int = 0, raw: bool = True) -> dict[str, Any]:
    """A chat logprob entry for ``token``, with ``top`` alternatives (``raw``: its bytes given,
    else null as chat allows)."""
    alts = [{"token": f"{token}~{i}", "logprob": value - 1 - i, "bytes": None} for i in range(top)]
    given = list(token.encode()) if raw else None
    return {"token": token, "logprob": value, "bytes": given, "top_logprobs": alts}


def _with_logprobs(*pieces: tuple[str, list[dict[str, Any]]]) -> list[bytes]:
    """A chat stream whose text chunks carry logprobs, as vLLM and llama-server send them."""
    items = [event(chunk(delta={"role": "assistant", "content": ""}))]
    for text, entries in pieces:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        items.append(event(chunk(choices=[{**choice, "logprobs": {"content": entries}}])))
    items.append(event(chunk(delta={}, finish="stop")))
    return [*items, event(chunk(choices=[], usage=USAGE)), DONE]


@pytest.mark.parametrize("stream", [True, False])
async def test_logprobs_asked_for_come_back_on_the_text(
    gateway: Gw, engine: FakeEngine, stream: bool
) -> None:
    """``include: [message.output_text.logprobs]`` asks the engine for chat's logprobs (with
    ``top_logprobs`` alternatives); each delta event carries its own, the text all of them, in
    OpenAI's shape (bytes given where chat's are null)."""
    first, second = (
        [_lp("Hel", -0.5, top=2), _lp("lo", -0.25, top=2, raw=False)],
        [_lp("é", -1.0, top=2)],
    )
    engine.script = _with_logprobs(("Hello", first), ("é", second))
    body = {
        "model": "my-model",
        "input": "Greet.",
        "stream": stream,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    async with gateway.client() as c:
        r = await c.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    sent = engine.received[-1].body
    assert sent["logprobs"] is True and sent["top_logprobs"] == 2
    if stream:
        events, _ = events_of(r.text)
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert [(e["delta"], len(e["logprobs"])) for e in deltas] == [("Hello", 2), ("é", 1)]
        (done,) = [e for e in events if e["type"] == "response.output_text.done"]
        assert done["logprobs"] == deltas[0]["logprobs"] + deltas[1]["logprobs"]
        response = events[-1]["response"]
    else:
        response = r.json()
        validate_response(response)
    part = response["output"][0]["content"][0]
    assert part["text"] == "Helloé" and response["top_logprobs"] == 2
    tokens = part["logprobs"]
    assert [(t["token"], t["logprob"], t["bytes"]) for t in tokens] == [
        ("Hel", -0.5, [72, 101, 108]),
        ("lo", -0.25, [108, 111]),  # null in chat: the token's own UTF-8
        ("é", -1.0, [195, 169]),
    ]
    assert [a["token"] for a in tokens[0]["top_logprobs"]] == ["Hel~0", "Hel~1"]
    assert tokens[2]["top_logprobs"][1] == {
        "token": "é~1",
        "logprob": -3.0,
        "bytes": list("é~1".encode()),
    }


async def test_top_logprobs_without_the_include_asks_the_engine_for_none(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = _script({"content": "ok"})
    async with gateway.client() as c:
        r = await c.post(
            "/v1/responses", json={"model": "my-model", "input": "x", "top_logprobs": 3}
        )
    assert r.status_code == 200, r.text
    assert r.json()["top_logprobs"] == 3
    assert r.json()["output"][0]["content"][0]["logprobs"] == []
    sent = engine.received[-1].body
    assert "logprobs" not in sent and "top_logprobs" not in sent


@pytest.mark.parametrize(
    "entries",
    [
        [{"token": "a"}],  # no logprob
        [{"token": 7, "logprob": -1.0, "bytes": None, "top_logprobs": []}],
        [{"token": "a", "logprob": -1.0, "bytes": [300], "top_logprobs": []}],
        [{"token": "a", "logprob": "-1", "bytes": None, "top_logprobs": []}],
    ],
)
async def test_logprobs_not_in_chats_shape_end_the_answer_unverified(
    gateway: Gw, engine: FakeEngine, entries: list[Any]
) -> None:
    engine.script = _with_logprobs(("a", entries))
    body = {
        "model": "my-model",
        "input": "x",
        "stream": True,
        "include": ["message.output_text.logprobs"],
    }
    async with gateway.client() as c:
        r = await c.post("/v1/responses", json=body)
    events, _ = events_of(r.text)
    assert events[-2]["type"] == "error" and events[-2]["code"] == "stream_unverified"
    assert events[-1]["type"] == "response.failed"
    assert "a" not in [e.get("delta") for e in events]  # nothing of the read that failed


@pytest.mark.parametrize(
    ("body", "status", "code", "words"),
    [
        ({"previous_response_id": "resp_1"}, 400, "invalid_request", "keeps no responses"),
        ({"conversation": "conv_1"}, 400, "invalid_request", "keeps no responses"),
        ({"background": True}, 400, "invalid_request", "keeps no responses"),
        ({"include": ["file_search_call.results"]}, 400, "unsupported_parameter", "include"),
        ({"include": "reasoning.encrypted_content"}, 400, "invalid_request", "list of strings"),
        ({"truncation": "auto"}, 400, "unsupported_parameter", "never drops input"),
        ({"truncation": "x"}, 400, "invalid_request", "truncation"),
        ({"prompt_cache_key": "k" * 1025}, 400, "invalid_request", "prompt_cache_key"),
        ({"user": 7}, 400, "invalid_request", "user"),
        ({"safety_identifier": "u"}, 400, "invalid_request", "`safety_identifier` is not"),
        ({"top_logprobs": 21}, 400, "invalid_request", "top_logprobs"),
        ({"top_logprobs": True}, 400, "invalid_request", "top_logprobs"),
        ({"top_logprobs": "2"}, 400, "invalid_request", "top_logprobs"),
        ({"tools": [{"type": "web_search"}]}, 400, "unsupported_parameter", "function tools"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "unsupported_parameter", ""),
        ({"input": []}, 400, "invalid_request", "input is required"),
        ({"input": [{"role": "tool", "content": "x"}]}, 400, "invalid_request", "role"),
        ({"max_output_tokens": 0}, 400, "invalid_request", "max_output_tokens"),
        ({"tool_choice": "required"}, 400, "invalid_request", "needs tools"),
        ({"text": {"format": {"type": "json_schema"}}}, 400, "invalid_request", "json_schema"),
        (
            {"text": {"format": {"type": "json_schema", "name": "n", "schema": {}, "strict": 1}}},
            400,
            "invalid_request",
            "strict (true or false)",
        ),
        ({"metadata": {"k": 1}}, 400, "invalid_request", "metadata"),
        ({"model": "decider"}, 400, "api_mismatch", "POST /v1/systemone"),
        ({"model": "nope"}, 404, "unknown_model", ""),
        ({"model": "llama", "cache_salt": "s"}, 400, "cache_salt_unsupported", ""),
    ],
)
async def test_refusals_never_reach_an_engine(
    gateway: Gw, engine: FakeEngine, body: dict[str, Any], status: int, code: str, words: str
) -> None:
    async with gateway.client() as c:
        r = await c.post("/v1/responses", json={"model": "my-model", "input": "x", **body})
    assert r.status_code == status, r.text
    error = r.json()
    assert error["code"] == code and words in error["message"]
    assert engine.received == []


async def test_no_response_is_kept_to_get(gateway: Gw) -> None:
    async with gateway.client() as c:
        got = await c.get("/v1/responses/resp_123")
        cancel = await c.post("/v1/responses/resp_123/cancel")
        wrong = await c.get("/v1/responses")
    async with httpx.AsyncClient(base_url=gateway.url) as c:
        unkeyed = await c.get("/v1/responses/resp_123", headers={"Authorization": "Bearer no"})
    assert got.status_code == cancel.status_code == 404
    assert got.json()["code"] == "not_found" and "keeps no responses" in got.text
    assert wrong.status_code == 405 and wrong.headers["Allow"] == "POST"
    assert unkeyed.status_code == 401


async def test_an_answer_past_the_bound_fails_whole_or_in_band(
    engine: FakeEngine, make_gateway: Any
) -> None:
    gw = await make_gateway(
        {"limits": {"max_answer_bytes": 4096}, "deployments": [deployments(engine.url)]}
    )
    engine.script = _script(*[{"content": "x" * 1000}] * 6)
    async with gw.client() as c:
        whole = await c.post("/v1/responses", json={"model": "my-model", "input": "x"})
    assert whole.status_code == 502 and "over 4096 bytes" in whole.json()["message"]
    gate = Gate(asyncio.Event())
    script = _script(*[{"content": "x" * 1000}] * 6)
    engine.script = [*script[:2], gate, *script[2:]]
    body = {"model": "my-model", "input": "x", "stream": True}
    text = ""
    async with gw.client() as c, c.stream("POST", "/v1/responses", json=body) as r:
        async for part in r.aiter_text():
            text += part
            if "output_text.delta" in text:
                gate.opened.set()
    events, _ = events_of(text)
    assert events[-1]["type"] == "response.failed"
    assert "over 4096 bytes" in events[-1]["response"]["error"]["message"]


async def test_the_bound_counts_bytes_not_characters(engine: FakeEngine, make_gateway: Any) -> None:
    """A stream's Response keeps its text, bounded in bytes: 3,000 characters of two-byte
    text are 6,000 bytes, past a 4,096-byte bound (they were counted as 3,000, and passed);
    1,500 of them (3,000 bytes, and 704 for their item and three deltas) are within it. (A
    whole answer's engine read is bounded before it is folded, in the bytes the engine
    sent.)"""
    gw = await make_gateway(
        {"limits": {"max_answer_bytes": 4096}, "deployments": [deployments(engine.url)]}
    )
    body = {"model": "my-model", "input": "x", "stream": True}
    got = []
    for n in (1000, 500):
        engine.script = _script(*[{"content": "é" * n}] * 3)
        async with gw.client() as c:
            got.append(await c.post("/v1/responses", json=body))
    past, within = got  # the engine sends all at once: past fails before the stream starts
    assert past.status_code == 502 and "over 4096 bytes" in past.json()["message"]
    assert within.status_code == 200
    events, _ = events_of(within.text)
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "é" * 1500


async def test_responses_count_under_their_own_api(gateway: Gw, engine: FakeEngine) -> None:
    engine.script = _script({"content": "ok"})
    async with gateway.client() as c:
        for _ in range(2):
            assert (
                await c.post("/v1/responses", json={"model": "my-model", "input": "x"})
            ).status_code == 200
        await c.post("/v1/responses", json={"model": "my-model", "input": "x", "n": 2})
    got = samples((await scrape(gateway)).text)
    key = (("api", "responses"), ("deployment", "my-model"))
    assert got[("capyctl_requests_total", (*key, ("outcome", "completed")))] == 2
    assert got[("capyctl_requests_total", (*key, ("outcome", "refused")))] == 1


async def test_a_hang_up_closes_the_engines_connection_and_frees_the_slot(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = [*_script({"content": "Hel"})[:2], Hold()]
    body = {"model": "my-model", "input": "x", "stream": True}
    async with gateway.client() as c, c.stream("POST", "/v1/responses", json=body) as r:
        async for line in r.aiter_lines():
            if "output_text.delta" in line:
                break  # hang up with the answer under way
    with anyio.fail_after(5):
        await engine.hung_up.wait()
    queue = gateway.gateway.fleet.routes["my-model"].queue
    await eventually(lambda: queue.running == 0)


async def test_the_openai_client_reads_whole_streamed_and_sync_responses(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = MIXED
    base = gateway.url + "/v1"
    async with AsyncOpenAI(base_url=base, api_key=gateway.key, max_retries=0) as client:
        whole = await client.responses.create(model="my-model", input="Weather?")
        assert whole.output_text == "Let me look."
        assert [type(i).__name__ for i in whole.output] == [
            "ResponseReasoningItem",
            "ResponseOutputMessage",
            "ResponseFunctionToolCall",
            "ResponseFunctionToolCall",
        ]
        stream = await client.responses.create(model="my-model", input="Weather?", stream=True)
        kinds = [type(ev).__name__ async for ev in stream]
        assert kinds[0] == "ResponseCreatedEvent" and kinds[-1] == "ResponseCompletedEvent"
        assert "ResponseFunctionCallArgumentsDeltaEvent" in kinds
        async with client.responses.stream(model="my-model", input="Weather?") as helper:
            final = await helper.get_final_response()
        assert final.output_text == "Let me look."

    def sync() -> str:
        with OpenAI(base_url=base, api_key=gateway.key, max_retries=0) as client:
            return client.responses.create(model="my-model", input="Weather?").output_text

    assert await to_thread.run_sync(sync) == "Let me look."


async def test_items_the_openai_client_returns_are_taken_back_as_input(
    gateway: Gw, engine: FakeEngine
) -> None:
    """The multi-turn recipe of responses.md: each output item as the openai client returns it
    (``model_dump()``, its None fields and its own names such as ``async_`` included; from a
    whole Response, a streamed one and the stream helper's parsed one) is sent back with the
    next turn and taken (``phase`` was refused: 400)."""
    base = gateway.url + "/v1"
    async with AsyncOpenAI(base_url=base, api_key=gateway.key, max_retries=0) as client:
        engine.script = MIXED
        whole = await client.responses.create(model="my-model", input="Weather?")
        stream = await client.responses.create(model="my-model", input="Weather?", stream=True)
        streamed = [ev.response async for ev in stream if ev.type == "response.completed"]
        async with client.responses.stream(model="my-model", input="Weather?") as helper:
            parsed = await helper.get_final_response()
        for reply in (whole, *streamed, parsed):
            dumped = [item.model_dump() for item in reply.output]
            assert any("phase" in d for d in dumped) and any("async_" in d for d in dumped)
            history: Any = [  # plain dicts, as the recipe sends them
                {"role": "user", "content": "Weather?"},
                *dumped,
                {"type": "function_call_output", "call_id": "call_9", "output": "sunny"},
                {"type": "function_call_output", "call_id": "call_10", "output": "noon"},
            ]
            engine.script = _script({"content": "Sunny."})
            again = await client.responses.create(model="my-model", input=history)
            assert again.output_text == "Sunny."
            assert engine.received[-1].body["messages"] == [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": "Let me look.",
                    "tool_calls": [
                        {
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                        },
                        {
                            "id": "call_10",
                            "type": "function",
                            "function": {"name": "time", "arguments": "{}"},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "call_9", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_10", "content": "noon"},
            ]


async def test_cache_salt_unsupported_on_a_stream_is_told_in_band_as_on_chat(
    gateway: Gw, engine: FakeEngine
) -> None:
    """One rule for chat and Responses: a client that asked for a stream hears of the refusal
    on one (it got a 400 JSON body here, where chat answered its in-band event). Its form is
    a Responses stream's failure: created, in progress, the ``error`` event with the code, and
    ``response.failed``; the openai client's stream helper reads it. Whole, it is a 400."""
    body = {"model": "llama", "input": "x", "cache_salt": "tenant-a", "stream": True}
    async with gateway.client() as c:
        r = await c.post("/v1/responses", json=body, headers={"X-Request-Id": "salt-2"})
        whole = await c.post("/v1/responses", json={**body, "stream": False})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"] == "salt-2" and r.headers["x-capyctl-request-id"]
    events, comments = events_of(r.text)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "error",
        "response.failed",
    ]
    error = events[2]
    assert (error["code"], error["message"]) == (
        "cache_salt_unsupported",
        "this deployment's engine does not partition its prefix cache by cache_salt",
    )
    failed = events[-1]["response"]
    assert failed["output"] == [] and failed["model"] == "llama"
    assert failed["error"]["message"].startswith("cache_salt_unsupported: ")
    assert comments == []  # no figures: nothing was asked of an engine
    assert whole.status_code == 400 and whole.json()["code"] == "cache_salt_unsupported"
    assert engine.received == []
    async with AsyncOpenAI(
        base_url=gateway.url + "/v1", api_key=gateway.key, max_retries=0
    ) as client:
        stream = await client.responses.create(
            model="llama", input="x", stream=True, extra_body={"cache_salt": "tenant-a"}
        )
        kinds = [ev.type async for ev in stream]
    assert kinds[2:] == ["error", "response.failed"]
    got = samples((await scrape(gateway)).text)
    key = (("api", "responses"), ("deployment", "llama"), ("outcome", "refused"))
    assert got[("capyctl_requests_total", key)] == 3


async def test_one_byte_reasoning_and_text_in_turn_reach_the_bound_soon(
    engine: FakeEngine, make_gateway: Any
) -> None:
    """Each delta of reasoning after text (or text after reasoning) begins an output item: at
    one byte each against the bound, a 16 KiB bound let 16,384 items through, and the client
    was sent 24 MB. The bound counts each item and each delta, so what the client is sent
    stays within six times the bound (its end events repeat the text four times)."""
    bound = 16 * 1024
    gw = await make_gateway(
        {"limits": {"max_answer_bytes": bound}, "deployments": [deployments(engine.url)]}
    )
    gate = Gate(asyncio.Event())
    script = _script(*[{"reasoning" if i % 2 else "content": "a"} for i in range(20_000)])
    engine.script = [*script[:2], gate, *script[2:]]
    body = {"model": "my-model", "input": "x", "stream": True}
    received = b""
    async with gw.client() as c, c.stream("POST", "/v1/responses", json=body) as r:
        async for part in r.aiter_bytes():
            received += part
            if b"output_text.delta" in received:
                gate.opened.set()
    assert len(received) <= 6 * bound, len(received)
    events, _ = events_of(received.decode())
    assert events[-1]["type"] == "response.failed"
    assert f"over {bound} bytes" in events[-1]["response"]["error"]["message"]
