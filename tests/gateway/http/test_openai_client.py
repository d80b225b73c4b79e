"""The official ``openai`` client against the gateway and the fake engine.

Every object the client parses is held to what the gateway sent: each parsed object dumped with
the fields it was given is the JSON on the wire, so no field the client exposes is lost,
renamed or defaulted, and the fields OpenAI's objects require (a choice's ``logprobs``, a
message's ``refusal``) were sent rather than filled in by the client. The gateway's refusals
arrive as the client's errors with our code in ``.code`` and our body in ``.body``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import orjson
import pytest
from anyio import to_thread
from openai import AsyncOpenAI
from pydantic import BaseModel

from tests.gateway.conftest import Gw
from tests.gateway.fake_engine import DONE, FakeEngine, chunk, event

pytestmark = pytest.mark.anyio

HELLO: list[Any] = [{"role": "user", "content": "Hello"}]
USAGE = {
    "prompt_tokens": 5,
    "completion_tokens": 3,
    "total_tokens": 8,
    "prompt_tokens_details": {"cached_tokens": 4},
}
METRICS = {"queue_time_ms": 0.5, "time_to_first_token_ms": 2.0, "mean_itl_ms": 1.0}


def _logprob(token: str, value: float) -> dict[str, Any]:
    return {"token": token, "logprob": value, "bytes": list(token.encode()), "top_logprobs": []}


def _script(*, logprobs: bool = False) -> list[dict[str, Any]]:
    """A vLLM 0.31-shaped stream, as chunks: role, text, finish, usage with vLLM's metrics."""
    chunks = [chunk(delta={"role": "assistant", "content": ""})]
    for text, value in (("Hel", -0.25), ("lo", -0.5)):
        c = chunk(delta={"content": text})
        if logprobs:
            c["choices"][0]["logprobs"] = {"content": [_logprob(text, value)]}
        chunks.append(c)
    chunks.append(chunk(delta={}, finish="stop"))
    chunks.append(chunk(choices=[], usage=USAGE, metrics=METRICS))
    return chunks


def _sent(model: BaseModel) -> Any:
    """What the client parsed, as the JSON it was given (nested models included)."""
    return model.model_dump(mode="json", exclude_unset=True)


@pytest.fixture
async def client(gateway: Gw) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(
        base_url=gateway.url + "/v1", api_key=gateway.key, max_retries=0, timeout=30
    ) as c:
        yield c


@pytest.mark.parametrize("logprobs", [False, True])
async def test_a_whole_answer_parses_to_what_the_gateway_sent(
    client: AsyncOpenAI, engine: FakeEngine, logprobs: bool
) -> None:
    engine.script = [*map(event, _script(logprobs=logprobs)), DONE]
    raw = await client.chat.completions.with_raw_response.create(
        model="my-model",
        messages=HELLO,
        extra_headers={"X-Request-Id": "checkout-7f3a"},
        logprobs=logprobs,
    )
    assert raw.headers["X-Request-Id"] == "checkout-7f3a"
    assert len(raw.headers["X-CapyCTL-Request-Id"]) == 26
    wire = orjson.loads(raw.http_response.content)
    reply = raw.parse()
    assert _sent(reply) == wire
    assert (reply.id, reply.object, reply.created, reply.model) == (
        "chatcmpl-1",
        "chat.completion",
        1796000000,
        "my-model",
    )
    (choice,) = reply.choices
    assert {"index", "finish_reason", "logprobs", "message"} <= choice.model_fields_set
    assert (choice.index, choice.finish_reason) == (0, "stop")
    assert {"role", "content", "refusal"} <= choice.message.model_fields_set
    message = choice.message
    assert (message.role, message.content, message.refusal) == ("assistant", "Hello", None)
    assert message.tool_calls is None and "tool_calls" not in message.model_fields_set
    if logprobs:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        got = [(t.token, t.logprob, t.bytes) for t in choice.logprobs.content]
        assert got == [("Hel", -0.25, [72, 101, 108]), ("lo", -0.5, [108, 111])]
        assert {"content", "refusal"} <= choice.logprobs.model_fields_set  # sent, as required
        assert choice.logprobs.refusal is None
    else:
        assert choice.logprobs is None
    usage = reply.usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (5, 3)
    assert usage.total_tokens == 8
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 4
    # Ours and the engine's own objects ride along as extra fields.
    assert reply.model_extra is not None and reply.model_extra["metrics"] == METRICS
    assert reply.model_extra["capyctl"]["metrics"]["queue_ms"] == {"value": 0.5, "source": "engine"}


async def test_a_stream_parses_chunk_by_chunk_to_what_the_engine_sent(
    client: AsyncOpenAI, engine: FakeEngine
) -> None:
    sent = _script(logprobs=True)
    engine.script = [*map(event, sent), DONE]
    async with client.chat.completions.with_streaming_response.create(
        model="my-model",
        messages=HELLO,
        stream=True,
        stream_options={"include_usage": True},
    ) as response:
        assert len(response.headers["X-CapyCTL-Request-Id"]) == 26
        chunks = [c async for c in await response.parse()]
    # Each chunk as the engine wrote it but for the model; the metrics comment is skipped.
    assert [_sent(c) for c in chunks] == [{**c, "model": "my-model"} for c in sent]
    first, text, _, finish, last = chunks
    assert (first.id, first.object, first.created, first.model) == (
        "chatcmpl-1",
        "chat.completion.chunk",
        1796000000,
        "my-model",
    )
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "")
    assert text.choices[0].index == 0 and text.choices[0].delta.content == "Hel"
    assert text.choices[0].finish_reason is None
    assert text.choices[0].logprobs is not None and text.choices[0].logprobs.content is not None
    assert text.choices[0].logprobs.content[0].logprob == -0.25
    assert finish.choices[0].finish_reason == "stop" and finish.choices[0].delta.content is None
    assert last.choices == [] and last.usage is not None and last.usage.total_tokens == 8


async def test_a_plain_stream_reads_as_the_guide_shows(
    client: AsyncOpenAI, engine: FakeEngine
) -> None:
    engine.script = [*map(event, _script()[:-1]), DONE]
    stream = await client.chat.completions.create(model="my-model", messages=HELLO, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == "Hello"


async def _refusal(call: Any, kind: type[openai.APIStatusError]) -> openai.APIStatusError:
    with pytest.raises(kind) as caught:
        await call
    err = caught.value
    assert err.status_code == err.response.status_code
    assert len(err.response.headers["X-CapyCTL-Request-Id"]) == 26
    assert isinstance(err.body, dict) and err.code == err.body["code"]
    assert err.body == orjson.loads(err.response.content)  # our documented object, whole
    return err


async def test_a_wrong_key_is_an_authentication_error(gateway: Gw, engine: FakeEngine) -> None:
    async with AsyncOpenAI(
        base_url=gateway.url + "/v1", api_key="wrong", max_retries=0, timeout=30
    ) as stranger:
        chat = stranger.chat.completions.create(model="my-model", messages=HELLO)
        err = await _refusal(chat, openai.AuthenticationError)
        listed = await _refusal(stranger.models.list(), openai.AuthenticationError)
        one = await _refusal(stranger.models.retrieve("my-model"), openai.AuthenticationError)
    assert err.body == {"code": "unauthorized", "message": "missing or invalid api key"}
    assert listed.code == one.code == "unauthorized"
    assert engine.received == []


async def test_an_unknown_model_is_not_found(client: AsyncOpenAI, engine: FakeEngine) -> None:
    chat = await _refusal(
        client.chat.completions.create(model="nobody", messages=HELLO), openai.NotFoundError
    )
    one = await _refusal(client.models.retrieve("nobody"), openai.NotFoundError)
    assert chat.code == one.code == "unknown_model"
    assert one.body == {"code": "unknown_model", "message": "no deployment serves model 'nobody'"}
    assert engine.received == []


@pytest.mark.parametrize(
    ("extra", "code"),
    [
        ({"extra_body": {"not_a_field": 1}}, "invalid_request"),
        ({"n": 2}, "unsupported_parameter"),
    ],
)
async def test_an_invalid_request_is_a_bad_request(
    client: AsyncOpenAI, engine: FakeEngine, extra: dict[str, Any], code: str
) -> None:
    create = client.chat.completions.create(model="my-model", messages=HELLO, **extra)
    err = await _refusal(create, openai.BadRequestError)
    assert err.code == code
    assert engine.received == []


async def test_an_error_inside_a_stream_is_an_api_error_with_our_code(
    client: AsyncOpenAI, engine: FakeEngine
) -> None:
    # cache_salt for llama.cpp, asked with a stream: one error event in a 200 stream.
    stream = await client.chat.completions.create(
        model="llama", messages=HELLO, stream=True, extra_body={"cache_salt": "tenant-a"}
    )
    with pytest.raises(openai.APIError) as caught:
        _ = [c async for c in stream]
    assert isinstance(caught.value.body, dict)
    assert caught.value.code == caught.value.body["code"] == "cache_salt_unsupported"
    assert engine.received == []


async def test_models_list_and_retrieve_parse_to_what_the_gateway_sent(
    gateway: Gw, client: AsyncOpenAI
) -> None:
    async with gateway.client() as c:
        wire = (await c.get("/v1/models")).json()
    page = await client.models.list()
    assert [_sent(m) for m in page.data] == wire["data"]
    names = [m.id for m in page.data]
    assert names == ["my-model", "llama", "decider"]
    for listed in page.data:
        one = await client.models.retrieve(listed.id)
        assert _sent(one) == _sent(listed)
        assert (one.id, one.object, one.owned_by) == (listed.id, "model", "capyctl")
        assert one.created == gateway.gateway.started_at
        assert one.model_extra == {
            "capyctl": {"api": "decisions" if one.id == "decider" else "chat"}
        }


async def test_the_request_id_reads_as_the_docs_show_with_the_sync_client(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = [*map(event, _script()), DONE]

    def run() -> tuple[str, str, str, str, str]:
        # docs/gateway/README.md, "Request IDs and logs", in a worker thread (the gateway
        # serves on this test's event loop).
        with openai.OpenAI(base_url=gateway.url + "/v1", api_key=gateway.key) as client:
            raw = client.chat.completions.with_raw_response.create(
                model="my-model", messages=HELLO, extra_headers={"X-Request-Id": "checkout-7f3a"}
            )
            reply = raw.parse()
            with client.chat.completions.with_streaming_response.create(
                model="my-model", messages=HELLO, stream=True
            ) as response:
                parts = [c.choices[0].delta.content for c in response.parse() if c.choices]
                text = "".join(p or "" for p in parts)
                streamed = response.headers["X-CapyCTL-Request-Id"]
        content = reply.choices[0].message.content or ""
        return (
            raw.headers["X-CapyCTL-Request-Id"],
            raw.headers["X-Request-Id"],
            content,
            streamed,
            text,
        )

    whole, caller, content, streamed, text = await to_thread.run_sync(run)
    assert len(whole) == len(streamed) == 26 and whole != streamed
    assert (caller, content, text) == ("checkout-7f3a", "Hello", "Hello")
