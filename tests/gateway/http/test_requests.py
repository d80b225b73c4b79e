"""The request edge: the API key, the model list, chat validation order, body limits, request IDs,
what reaches the engine, and the router's log line."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import orjson
import pytest

from capyctl_gateway._log import JsonFormatter, TextFormatter
from tests.gateway.conftest import KEY, WORKERS, Gw, deployments
from tests.gateway.fake_engine import FakeEngine, vllm_stream

workers = WORKERS

pytestmark = pytest.mark.anyio

MakeGateway = Callable[..., Awaitable[Gw]]
CHAT: dict[str, Any] = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}]}
CHAT_PATH = "/v1/chat/completions"
ULID = re.compile(r"^[0-7][0-9A-HJKMNP-TV-Z]{25}$")
CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
SALT_UNSUPPORTED = "this deployment's engine does not partition its prefix cache by cache_salt"
# What the gateway itself sends an engine; nothing a client sent may be added to it.
ENGINE_HEADERS = {
    "host",
    "content-type",
    "accept",
    "accept-encoding",
    "content-length",
    "user-agent",
    "connection",  # llama.cpp deployments: close (llama-server closes after a stream anyway)
}


def error(r: httpx.Response, status: int, code: str) -> str:
    """Assert ``r`` is the documented error object; return its message."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"code", "message"}, body
    assert body["code"] == code
    assert isinstance(body["message"], str) and body["message"]
    return str(body["message"])


def capyctl_id(r: httpx.Response) -> str:
    rid = r.headers.get("x-capyctl-request-id")
    assert rid is not None and ULID.match(rid), rid
    return str(rid)


def ulid_ms(rid: str) -> int:
    value = 0
    for c in rid:
        value = value * 32 + CROCKFORD.index(c)
    return value >> 80


async def post(
    gw: Gw, body: dict[str, Any] | bytes, headers: Any = None, **kw: Any
) -> httpx.Response:
    async with gw.client() as c:
        if isinstance(body, bytes):
            return await c.post(CHAT_PATH, content=body, headers=headers, **kw)
        return await c.post(CHAT_PATH, json=body, headers=headers, **kw)


async def raw_exchange(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` verbatim on a fresh connection; read the answer's status, headers and
    body. The bound fails a test whose gateway waits for bytes that are never sent."""
    u = urlsplit(url)
    with anyio.fail_after(10):
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        try:
            writer.write(request)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ")[1])
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(":") for line in lines[1:] if line)
            }
            body = await reader.readexactly(int(headers.get("content-length", "0")))
        finally:
            writer.close()
            await writer.wait_closed()
    return status, headers, body


def padded(size: int, **extra: Any) -> bytes:
    """A valid chat body of exactly ``size`` bytes (JSON allows trailing whitespace)."""
    raw = orjson.dumps({**CHAT, **extra})
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


# -- the API key ------------------------------------------------------------------------------
BAD_AUTH = [
    pytest.param(None, id="missing"),
    pytest.param("", id="empty"),
    pytest.param(f"Basic {KEY}", id="basic-scheme"),
    pytest.param(f"Token {KEY}", id="token-scheme"),
    pytest.param(KEY, id="no-scheme"),
    pytest.param(f"Bearer{KEY}", id="no-space"),
    pytest.param("Bearer", id="scheme-only"),
    pytest.param("Bearer wrong-key", id="wrong-key"),
    pytest.param(f"Bearer {KEY[:-1]}", id="key-prefix"),
    pytest.param(f"Bearer {KEY}x", id="key-extended"),
    pytest.param(f"Bearer {KEY.upper()}", id="key-case"),
]


def auth_client(gw: Gw, auth: str | None) -> httpx.AsyncClient:
    headers = {} if auth is None else {"Authorization": auth}
    return httpx.AsyncClient(base_url=gw.url, headers=headers, timeout=30)


@pytest.mark.parametrize("auth", BAD_AUTH)
async def test_chat_without_the_right_key_is_401(
    gateway: Gw, engine: FakeEngine, auth: str | None
) -> None:
    engine.script = vllm_stream()
    async with auth_client(gateway, auth) as c:
        r = await c.post(CHAT_PATH, json=CHAT)
    error(r, 401, "unauthorized")
    capyctl_id(r)
    assert r.headers["www-authenticate"] == "Bearer"  # how to authenticate (RFC 6750)
    assert engine.received == []


@pytest.mark.parametrize("auth", BAD_AUTH)
async def test_models_without_the_right_key_is_401(
    gateway: Gw, engine: FakeEngine, auth: str | None
) -> None:
    async with auth_client(gateway, auth) as c:
        r = await c.get("/v1/models")
    error(r, 401, "unauthorized")
    assert engine.received == []


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
async def test_the_scheme_is_case_insensitive(gateway: Gw, engine: FakeEngine, scheme: str) -> None:
    engine.script = vllm_stream()
    async with auth_client(gateway, f"{scheme} {KEY}") as c:
        chat = await c.post(CHAT_PATH, json=CHAT)
        models = await c.get("/v1/models")
    assert chat.status_code == 200, chat.text
    assert models.status_code == 200, models.text
    assert len(engine.received) == 1


async def test_wrong_key_is_refused_before_an_oversized_body_is_read(
    gateway: Gw, engine: FakeEngine
) -> None:
    declared = 64 * 1024 * 1024 + 1  # over the default limit; not one byte of it is sent
    status, headers, body = await raw_exchange(
        gateway.url,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer wrong\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % declared,
    )
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert orjson.loads(body) == {"code": "unauthorized", "message": "missing or invalid api key"}
    assert ULID.match(headers["x-capyctl-request-id"])
    assert engine.received == []


async def test_wrong_key_is_refused_without_waiting_for_the_body(
    gateway: Gw, engine: FakeEngine
) -> None:
    # Within the limit, but never sent: a gateway that read the body first would wait forever.
    status, _, body = await raw_exchange(
        gateway.url,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer wrong\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{",
    )
    assert status == 401
    assert orjson.loads(body)["code"] == "unauthorized"
    assert engine.received == []


async def test_the_right_key_with_an_oversized_declared_body_is_413_before_reading(
    gateway: Gw, engine: FakeEngine
) -> None:
    status, headers, body = await raw_exchange(
        gateway.url,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer "
        + KEY.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % (64 * 1024 * 1024 + 1),
    )
    assert status == 413
    assert orjson.loads(body)["code"] == "request_too_large"
    assert ULID.match(headers["x-capyctl-request-id"])
    assert engine.received == []


@pytest.mark.parametrize("path", [b"GET /v1/models", b"POST /v1/chat/completions"])
async def test_a_key_that_is_not_utf8_is_401_not_500(
    gateway: Gw, engine: FakeEngine, path: bytes
) -> None:
    status, _, body = await raw_exchange(
        gateway.url,
        path + b" HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer \xff\xfe\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
    )
    assert status == 401
    assert orjson.loads(body)["code"] == "unauthorized"
    assert engine.received == []


# -- the model list ---------------------------------------------------------------------------
async def test_models_lists_every_deployment_with_its_api(gateway: Gw, engine: FakeEngine) -> None:
    async with gateway.client() as c:
        r = await c.get("/v1/models")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    doc = r.json()
    created = doc["data"][0]["created"]
    assert isinstance(created, int) and abs(created - time.time()) < 3600
    common = {"object": "model", "created": created, "owned_by": "capyctl"}
    assert doc == {
        "object": "list",
        "data": [
            {"id": "my-model", **common, "capyctl": {"api": "chat"}},
            {"id": "llama", **common, "capyctl": {"api": "chat"}},
            {"id": "decider", **common, "capyctl": {"api": "decisions"}},
        ],
    }
    assert engine.received == []


@pytest.fixture
async def silent_engine() -> AsyncIterator[str]:
    """An origin that accepts connections and never answers: anything that waits on it hangs."""
    held: list[asyncio.StreamWriter] = []

    def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # a plain callback: it runs as the connection is accepted

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for writer in held:
            writer.transport.abort()
        await server.wait_closed()


async def test_models_answers_without_any_engine(
    make_gateway: MakeGateway, silent_engine: str
) -> None:
    gw = await make_gateway(
        {"deployments": [deployments(silent_engine, name="only", engine="sglang")]}
    )
    with anyio.fail_after(5):
        async with gw.client() as c:
            first = await c.get("/v1/models")
            second = await c.get("/v1/models")
    (entry,) = first.json()["data"]
    assert entry == {
        "id": "only",
        "object": "model",
        "created": entry["created"],
        "owned_by": "capyctl",
        "capyctl": {"api": "chat"},
    }
    assert second.json() == first.json()


# -- chat validation, in its documented order ------------------------------------------------
REFUSALS = [
    # The body is JSON with a string model.
    pytest.param(b"not json", 400, "invalid_request", None, id="not-json"),
    pytest.param(b"", 400, "invalid_request", None, id="empty-body"),
    pytest.param(b'["my-model"]', 400, "invalid_request", None, id="not-an-object"),
    pytest.param({"messages": []}, 400, "invalid_request", "model", id="no-model"),
    pytest.param({"model": 5, "messages": []}, 400, "invalid_request", "model", id="model-int"),
    pytest.param({"model": None}, 400, "invalid_request", "model", id="model-null"),
    pytest.param({"model": ""}, 400, "invalid_request", "model", id="model-empty"),
    # The model exists: checked before the fields, n and the salt.
    pytest.param({"model": "nope"}, 404, "unknown_model", "nope", id="unknown-model"),
    pytest.param(
        {"model": "nope", "return_hidden_states": True, "n": 2, "cache_salt": ""},
        404,
        "unknown_model",
        "nope",
        id="unknown-model-beats-fields",
    ),
    pytest.param({"model": "MY-MODEL"}, 404, "unknown_model", None, id="model-case"),
    # It is a chat deployment: checked before the fields and the salt.
    pytest.param({"model": "decider"}, 400, "api_mismatch", None, id="decisions"),
    pytest.param(
        {"model": "decider", "return_hidden_states": True},
        400,
        "api_mismatch",
        None,
        id="decisions-beats-unknown-field",
    ),
    pytest.param(
        {"model": "decider", "cache_salt": "t", "n": 3},
        400,
        "api_mismatch",
        None,
        id="decisions-beats-salt-and-n",
    ),
    # Every field is known: checked before n and the salt.
    pytest.param(
        {**CHAT, "return_hidden_states": True},
        400,
        "invalid_request",
        "return_hidden_states",
        id="unknown-field",
    ),
    pytest.param(
        {**CHAT, "n": 2, "cache_salt": "", "bogus_extension": 1},
        400,
        "invalid_request",
        "bogus_extension",
        id="unknown-field-beats-n-and-salt",
    ),
    pytest.param(
        {**CHAT, "cache_salt": "t", "return_hidden_states": True},
        400,
        "invalid_request",
        "return_hidden_states",
        id="unknown-field-with-salt",
    ),
    # n is 1.
    pytest.param({**CHAT, "n": 2}, 400, "unsupported_parameter", "n", id="n-2"),
    pytest.param({**CHAT, "n": 0}, 400, "unsupported_parameter", "n", id="n-0"),
    pytest.param({**CHAT, "n": "1"}, 400, "unsupported_parameter", "n", id="n-string"),
    pytest.param(
        {**CHAT, "n": 2, "cache_salt": ""}, 400, "unsupported_parameter", "n", id="n-beats-salt"
    ),
    # stream and stream_options have their types.
    pytest.param({**CHAT, "stream": "yes"}, 400, "invalid_request", "stream", id="stream-str"),
    pytest.param(
        {**CHAT, "stream_options": 1}, 400, "invalid_request", "stream_options", id="options-int"
    ),
    # cache_salt is a non-empty string of at most 1024 bytes...
    pytest.param({**CHAT, "cache_salt": ""}, 400, "invalid_request", "cache_salt", id="salt-empty"),
    pytest.param(
        {**CHAT, "cache_salt": "a" * 1025}, 400, "invalid_request", "cache_salt", id="salt-1025"
    ),
    pytest.param(
        {**CHAT, "cache_salt": "é" * 513},  # 513 characters, 1026 bytes
        400,
        "invalid_request",
        "cache_salt",
        id="salt-multibyte-over",
    ),
    pytest.param({**CHAT, "cache_salt": 7}, 400, "invalid_request", "cache_salt", id="salt-int"),
    pytest.param(
        {**CHAT, "cache_salt": None}, 400, "invalid_request", "cache_salt", id="salt-null"
    ),
    pytest.param(
        {**CHAT, "cache_salt": ["t"]}, 400, "invalid_request", "cache_salt", id="salt-list"
    ),
    # ...and only for engines that partition their prefix cache by it.
    pytest.param(
        {**CHAT, "model": "llama", "cache_salt": "tenant-a"},
        400,
        "cache_salt_unsupported",
        SALT_UNSUPPORTED,
        id="salt-on-llamacpp",
    ),
]


@pytest.mark.parametrize(("body", "status", "code", "names"), REFUSALS)
async def test_chat_refusals_reach_no_engine(
    gateway: Gw,
    engine: FakeEngine,
    body: dict[str, Any] | bytes,
    status: int,
    code: str,
    names: str | None,
) -> None:
    engine.script = vllm_stream()
    r = await post(gateway, body)
    message = error(r, status, code)
    if names is not None:
        assert names in message
    capyctl_id(r)
    assert engine.received == []


async def test_api_mismatch_names_the_decisions_endpoint(gateway: Gw, engine: FakeEngine) -> None:
    r = await post(gateway, {"model": "decider", "messages": []})
    assert error(r, 400, "api_mismatch") == (
        "model decider serves the decisions API, which /v1/chat/completions does not answer; "
        "send its requests to POST /v1/systemone"
    )
    assert engine.received == []


async def test_cache_salt_unsupported_is_the_documented_object(
    gateway: Gw, engine: FakeEngine
) -> None:
    r = await post(gateway, {**CHAT, "model": "llama", "cache_salt": "tenant-a"})
    assert r.status_code == 400
    assert r.json() == {"code": "cache_salt_unsupported", "message": SALT_UNSUPPORTED}
    assert r.headers["x-capyctl-request-id"]
    assert engine.received == []


async def test_cache_salt_unsupported_on_a_stream_is_one_error_event(
    gateway: Gw, engine: FakeEngine
) -> None:
    # The spec: "400 with code cache_salt_unsupported (on a stream, an error event with that
    # code)": the client asked for a stream, so it hears of the refusal on one.
    body = {**CHAT, "model": "llama", "cache_salt": "tenant-a", "stream": True}
    r = await post(gateway, body, headers={"X-Request-Id": "salt-1"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"] == "salt-1" and r.headers["x-capyctl-request-id"]
    events = [line for line in r.text.split("\n\n") if line]
    assert events == [
        "data: "
        + json.dumps(
            {
                "error": {
                    "code": "cache_salt_unsupported",
                    "message": SALT_UNSUPPORTED,
                    "retryable": False,
                }
            },
            separators=(",", ":"),
        )
    ]
    assert engine.received == []


async def test_the_same_request_without_cache_salt_is_served_by_llamacpp(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = vllm_stream()
    r = await post(gateway, {**CHAT, "model": "llama"})
    assert r.status_code == 200, r.text
    assert len(engine.received) == 1
    assert "cache_salt" not in engine.received[0].body


@pytest.mark.parametrize(
    "salt", ["tenant-a", "a" * 1024, "é" * 512, 't\u00e9nant \U0001f600 "q"'], ids=str.__len__
)
async def test_a_valid_cache_salt_reaches_vllm_unchanged(
    gateway: Gw, engine: FakeEngine, salt: str
) -> None:
    engine.script = vllm_stream()
    r = await post(gateway, {**CHAT, "cache_salt": salt})
    assert r.status_code == 200, r.text
    assert [rec.body["cache_salt"] for rec in engine.received] == [salt]


async def test_cache_salt_follows_the_engine_family(
    make_gateway: MakeGateway, engine: FakeEngine
) -> None:
    gw = await make_gateway(
        {
            "deployments": [
                deployments(engine.url, name="sg", engine="sglang", engine_version="0.5.20"),
                deployments(engine.url, name="tf", engine="tensorfold", engine_version="0.6.1"),
            ]
        }
    )
    engine.script = vllm_stream()
    refused = await post(gw, {**CHAT, "model": "tf", "cache_salt": "tenant-a"})
    assert refused.json() == {"code": "cache_salt_unsupported", "message": SALT_UNSUPPORTED}
    assert engine.received == []
    await post(gw, {**CHAT, "model": "sg", "cache_salt": "tenant-a"})
    assert [rec.body.get("cache_salt") for rec in engine.received] == ["tenant-a"]


@pytest.mark.parametrize("n", [1, None])
async def test_n_of_one_is_served(gateway: Gw, engine: FakeEngine, n: int | None) -> None:
    engine.script = vllm_stream()
    r = await post(gateway, {**CHAT, "n": n})
    assert r.status_code == 200, r.text
    assert len(engine.received) == 1


async def test_documented_extensions_reach_the_engine_unchanged(
    gateway: Gw, engine: FakeEngine
) -> None:
    extensions: dict[str, Any] = {
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "chat_template_kwargs": {"enable_thinking": False},
        "structured_outputs": {"regex": "[a-z]+"},
        "include_reasoning": False,
        "seed": 7,
        "user": "u-1",
        "metadata": {"k": "v"},
    }
    engine.script = vllm_stream()
    r = await post(gateway, {**CHAT, **extensions})
    assert r.status_code == 200, r.text
    (received,) = engine.received
    assert {k: received.body[k] for k in extensions} == extensions
    assert received.body["messages"] == CHAT["messages"]


# -- body size ----------------------------------------------------------------------------------
@pytest.fixture
async def small(make_gateway: MakeGateway, engine: FakeEngine) -> Gw:
    return await make_gateway(
        {"limits": {"max_body_bytes": 2048}, "deployments": [deployments(engine.url)]}
    )


async def chunked(data: bytes, size: int = 512) -> AsyncIterator[bytes]:
    """A body without a length: httpx sends it chunked."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def test_a_declared_body_over_the_limit_is_413(small: Gw, engine: FakeEngine) -> None:
    engine.script = vllm_stream()
    r = await post(small, padded(2049), headers={"X-Request-Id": "big-1"})
    message = error(r, 413, "request_too_large")
    assert "2048" in message
    capyctl_id(r)
    assert r.headers["x-request-id"] == "big-1"
    assert engine.received == []


async def test_a_chunked_body_over_the_limit_is_413(small: Gw, engine: FakeEngine) -> None:
    engine.script = vllm_stream()
    async with small.client() as c:
        r = await c.post(
            CHAT_PATH, content=chunked(padded(4096)), headers={"X-Request-Id": "big-2"}
        )
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in r.request.headers
    error(r, 413, "request_too_large")
    capyctl_id(r)
    assert r.headers["x-request-id"] == "big-2"
    assert engine.received == []


async def test_a_chunked_body_just_over_the_limit_is_413(small: Gw, engine: FakeEngine) -> None:
    engine.script = vllm_stream()
    async with small.client() as c:
        r = await c.post(CHAT_PATH, content=chunked(padded(2049), 2049))
    error(r, 413, "request_too_large")
    assert engine.received == []


@pytest.mark.parametrize("framing", ["declared", "chunked"])
async def test_a_body_at_the_limit_is_served(small: Gw, engine: FakeEngine, framing: str) -> None:
    engine.script = vllm_stream()
    body = padded(2048)
    async with small.client() as c:
        content: bytes | AsyncIterator[bytes] = body if framing == "declared" else chunked(body)
        r = await c.post(CHAT_PATH, content=content)
    assert r.status_code == 200, r.text
    assert len(engine.received) == 1


# -- request IDs ------------------------------------------------------------------------------
async def test_a_served_answer_carries_both_ids_and_the_engine_gets_neither(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = vllm_stream()
    before = int(time.time() * 1000)
    r = await post(gateway, CHAT, headers={"X-Request-Id": "checkout-7f3a"})
    after = int(time.time() * 1000)
    assert r.status_code == 200, r.text
    rid = capyctl_id(r)
    assert before <= ulid_ms(rid) <= after
    assert r.headers["x-request-id"] == "checkout-7f3a"
    (received,) = engine.received
    assert "x-request-id" not in {k.lower() for k in received.headers}
    assert "checkout-7f3a" not in repr(received)
    assert rid not in repr(received)


async def test_a_stream_carries_both_ids_in_its_headers(gateway: Gw, engine: FakeEngine) -> None:
    engine.script = vllm_stream()
    r = await post(gateway, {**CHAT, "stream": True}, headers={"X-Request-Id": "s-1"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    capyctl_id(r)
    assert r.headers["x-request-id"] == "s-1"
    (received,) = engine.received
    assert "x-request-id" not in {k.lower() for k in received.headers}


@pytest.mark.parametrize(
    ("body", "status"),
    [
        pytest.param({**CHAT, "bogus": 1}, 400, id="400"),
        pytest.param({**CHAT, "model": "nope"}, 404, id="404"),
        pytest.param({**CHAT, "model": "decider"}, 400, id="api-mismatch"),
        pytest.param({**CHAT, "n": 2}, 400, id="unsupported"),
    ],
)
async def test_refusals_after_auth_hand_the_caller_id_back(
    gateway: Gw, engine: FakeEngine, body: dict[str, Any], status: int
) -> None:
    r = await post(gateway, body, headers={"X-Request-Id": "caller.id:42"})
    assert r.status_code == status
    capyctl_id(r)
    assert r.headers["x-request-id"] == "caller.id:42"
    assert engine.received == []


async def test_every_answer_gets_a_fresh_capyctl_id(gateway: Gw, engine: FakeEngine) -> None:
    engine.script = vllm_stream()
    before = int(time.time() * 1000)
    answers = [
        await post(gateway, CHAT),
        await post(gateway, CHAT),
        await post(gateway, {**CHAT, "stream": True}),
        await post(gateway, {**CHAT, "model": "nope"}),
        await post(gateway, {**CHAT, "model": "nope"}),
        await post(gateway, b"{"),
    ]
    async with auth_client(gateway, "Bearer wrong") as c:
        answers.append(await c.post(CHAT_PATH, json=CHAT))
    after = int(time.time() * 1000)
    assert [a.status_code for a in answers] == [200, 200, 200, 404, 404, 400, 401]
    ids = [capyctl_id(a) for a in answers]
    assert len(set(ids)) == len(ids)
    assert all(before <= ulid_ms(i) <= after for i in ids)


async def test_the_caller_id_is_not_handed_back_without_the_key(
    gateway: Gw, engine: FakeEngine
) -> None:
    async with auth_client(gateway, "Bearer wrong") as c:
        r = await c.post(CHAT_PATH, json=CHAT, headers={"X-Request-Id": "not a valid id"})
    error(r, 401, "unauthorized")  # the key is checked before the caller's id
    capyctl_id(r)
    assert "x-request-id" not in r.headers
    assert engine.received == []


@pytest.mark.parametrize(
    "value",
    ["a", "x" * 128, "!#$%&'()*+,-./09:;<=>?@AZ[\\]^_`az{|}~", "01K7ZQ3M4X9V2B8N6C5D1F0G7H"],
)
async def test_valid_caller_ids_are_handed_back_exactly(
    gateway: Gw, engine: FakeEngine, value: str
) -> None:
    engine.script = vllm_stream()
    r = await post(gateway, CHAT, headers={"X-Request-Id": value})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == value
    assert len(engine.received) == 1


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({"X-Request-Id": "a b"}, id="space"),
        pytest.param({"X-Request-Id": "a\tb"}, id="tab"),
        pytest.param({"X-Request-Id": "x" * 129}, id="129-chars"),
        pytest.param({"X-Request-Id": ""}, id="empty"),
        pytest.param({"X-Request-Id": "caf\u00e9".encode()}, id="non-ascii"),
        pytest.param({"X-Request-Id": b"\xff\xfe"}, id="not-utf8"),
        pytest.param([("X-Request-Id", "one"), ("X-Request-Id", "two")], id="twice"),
        pytest.param([("X-Request-Id", "same"), ("x-request-id", "same")], id="twice-same"),
    ],
)
async def test_invalid_caller_ids_are_400_before_any_engine(
    gateway: Gw, engine: FakeEngine, headers: Any
) -> None:
    engine.script = vllm_stream()
    r = await post(gateway, CHAT, headers=headers)
    assert "X-Request-Id" in error(r, 400, "invalid_request")
    capyctl_id(r)
    assert "x-request-id" not in r.headers
    assert engine.received == []


async def test_an_invalid_caller_id_is_refused_before_the_body_is_read(
    gateway: Gw, engine: FakeEngine
) -> None:
    status, _, body = await raw_exchange(
        gateway.url,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer "
        + KEY.encode()
        + b"\r\nX-Request-Id: a b\r\nContent-Length: 1000\r\n\r\n{",
    )
    assert status == 400
    assert orjson.loads(body)["code"] == "invalid_request"
    assert engine.received == []


# -- what reaches the engine ------------------------------------------------------------------
async def test_no_client_header_reaches_the_engine(gateway: Gw, engine: FakeEngine) -> None:
    engine.script = vllm_stream()
    r = await post(
        gateway,
        CHAT,
        headers={
            "X-Request-Id": "caller-1",
            "X-Conversation-Id": "conv-9",
            "Cookie": "session=secret-cookie",
            "User-Agent": "client-agent/1.0",
            "X-Forwarded-For": "10.9.8.7",
            "OpenAI-Organization": "org-1",
            "Traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        },
    )
    assert r.status_code == 200, r.text
    (received,) = engine.received
    names = {k.lower() for k in received.headers}
    assert names <= ENGINE_HEADERS, names - ENGINE_HEADERS
    assert received.headers["Accept"] == "text/event-stream"
    assert received.headers["Content-Type"] == "application/json"
    assert received.headers["Accept-Encoding"] == "identity"  # a stream we can parse as it comes
    assert received.headers["User-Agent"] == "capyctl-gateway"
    values = " ".join(received.headers.values())
    for sent in ("caller-1", "conv-9", "secret-cookie", "client-agent", "10.9.8.7", KEY):
        assert sent not in values


async def test_the_engine_gets_its_own_key_never_the_gateways(
    make_gateway: MakeGateway, engine: FakeEngine
) -> None:
    dep = deployments(engine.url)
    dep["instances"] = [{"url": engine.url, "api_key_env": "ENGINE_KEY"}]
    gw = await make_gateway({"deployments": [dep]}, env={"ENGINE_KEY": "engine-secret"})
    engine.script = vllm_stream()
    r = await post(gw, CHAT)
    assert r.status_code == 200, r.text
    (received,) = engine.received
    assert received.headers["Authorization"] == "Bearer engine-secret"
    assert KEY not in repr(received)


async def test_a_collected_request_asks_the_engine_for_a_stream_with_usage(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = vllm_stream()
    r = await post(gateway, CHAT)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "my-model"
    assert [rec.body for rec in engine.received] == [
        {**CHAT, "model": "tiny", "stream": True, "stream_options": {"include_usage": True}}
    ]


async def test_a_collected_request_gets_usage_even_when_it_declined_it(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = vllm_stream()
    body = {
        **CHAT,
        "stream": False,
        "stream_options": {"include_usage": False, "continuous_usage_stats": False},
    }
    r = await post(gateway, body)
    assert r.status_code == 200, r.text
    assert [rec.body for rec in engine.received] == [
        {
            **CHAT,
            "model": "tiny",
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": False},
        }
    ]


async def test_a_stream_without_stream_options_gets_none_added(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = vllm_stream()
    r = await post(gateway, {**CHAT, "stream": True})
    assert r.status_code == 200, r.text
    assert [rec.body for rec in engine.received] == [{**CHAT, "model": "tiny", "stream": True}]


@pytest.mark.parametrize("include", [True, False])
async def test_a_streams_own_stream_options_are_kept(
    gateway: Gw, engine: FakeEngine, include: bool
) -> None:
    engine.script = vllm_stream()
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": include}}
    r = await post(gateway, body)
    assert r.status_code == 200, r.text
    assert [rec.body for rec in engine.received] == [{**body, "model": "tiny"}]


async def test_without_served_model_the_engine_gets_the_deployment_name(
    make_gateway: MakeGateway, engine: FakeEngine
) -> None:
    dep = deployments(engine.url, name="tiny")
    del dep["served_model"]
    gw = await make_gateway({"deployments": [dep]})
    engine.script = vllm_stream()
    r = await post(gw, {**CHAT, "model": "tiny"})
    assert r.status_code == 200, r.text
    assert [rec.body["model"] for rec in engine.received] == ["tiny"]


# -- the router's log line --------------------------------------------------------------------
def selections(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "capyctl_gateway" and getattr(r, "event", None) == "router_selection"
    ]


async def test_the_router_line_names_both_ids_the_deployment_and_instance(
    gateway: Gw, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    engine.script = vllm_stream()
    r = await post(gateway, CHAT, headers={"X-Request-Id": "checkout-7f3a"})
    assert r.status_code == 200, r.text
    rid = capyctl_id(r)
    short = gateway.gateway.fleet.routes["my-model"].id
    assert re.fullmatch(r"[0-9A-HJKMNP-TV-Z]{12}", short), short
    this = socket.gethostname()  # an engine on loopback runs on this machine
    (record,) = selections(caplog)
    assert record.getMessage() == (
        f"request {rid} (caller checkout-7f3a) {short} -> {this} instance 0"
    )
    assert record.fields == {  # type: ignore[attr-defined]
        "capyctl_request_id": rid,
        "caller_request_id": "checkout-7f3a",
        "deployment": "my-model",
        "deployment_id": short,
        "instance": 0,
        "host": "127.0.0.1",
        "machine": this,
    }
    text = TextFormatter().format(record)
    assert re.fullmatch(
        rf"\d\d:\d\d:\d\d request {rid} \(caller checkout-7f3a\) {short} -> {re.escape(this)} "
        r"instance 0",
        text,
    ), text
    doc = orjson.loads(JsonFormatter().format(record))
    assert doc["event"] == "router_selection"
    assert doc["capyctl_request_id"] == rid
    assert doc["caller_request_id"] == "checkout-7f3a"


async def test_without_a_caller_id_the_line_shows_only_capyctls(
    gateway: Gw, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    engine.script = vllm_stream()
    r = await post(gateway, {**CHAT, "model": "llama", "stream": True})
    assert r.status_code == 200, r.text
    rid = capyctl_id(r)
    short = gateway.gateway.fleet.routes["llama"].id
    this = socket.gethostname()
    (record,) = selections(caplog)
    assert record.getMessage() == f"request {rid} {short} -> {this} instance 0"
    assert record.fields == {  # type: ignore[attr-defined]
        "capyctl_request_id": rid,
        "deployment": "llama",
        "deployment_id": short,
        "instance": 0,
        "host": "127.0.0.1",
        "machine": this,
    }


async def test_refusals_log_no_router_line(
    gateway: Gw, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    await post(gateway, {**CHAT, "model": "nope"}, headers={"X-Request-Id": "r-1"})
    await post(gateway, {**CHAT, "bogus": 1})
    assert selections(caplog) == []
    assert engine.received == []


async def test_no_key_appears_in_any_log_record(
    make_gateway: MakeGateway, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    dep = deployments(engine.url)
    dep["instances"] = [{"url": engine.url, "api_key_env": "ENGINE_KEY"}]
    engine_key = "engine-secret-" + "e" * 30
    wrong = "wrong-" + "w" * 40
    gw = await make_gateway({"deployments": [dep]}, env={"ENGINE_KEY": engine_key})
    engine.script = vllm_stream()
    served = await post(gw, CHAT, headers={"X-Request-Id": "log-1"})
    streamed = await post(gw, {**CHAT, "stream": True})
    refused = await post(gw, {**CHAT, "model": "nope"})
    async with auth_client(gw, f"Bearer {wrong}") as c:
        unauthorized = await c.post(CHAT_PATH, json=CHAT)
        listed = await c.get("/v1/models")
    assert [a.status_code for a in (served, streamed, refused, unauthorized, listed)] == [
        200,
        200,
        404,
        401,
        401,
    ]
    assert len(selections(caplog)) == 2  # the capture saw the gateway's records
    for record in caplog.records:
        rendered = " ".join(
            [
                record.getMessage(),
                repr(vars(record)),
                TextFormatter().format(record),
                JsonFormatter().format(record),
            ]
        )
        for secret in (KEY, engine_key, wrong):
            assert secret not in rendered, record


@pytest.mark.parametrize("n", [True, 1.0, "1"])
async def test_n_must_be_the_integer_one(gateway: Gw, engine: FakeEngine, n: object) -> None:
    async with gateway.client() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "n": n})
    assert (r.status_code, r.json()["code"]) == (400, "unsupported_parameter")
    assert engine.received == []


async def test_the_chat_path_with_another_method_is_405_with_a_request_id(gateway: Gw) -> None:
    async with gateway.client() as c:
        r = await c.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["code"] == "method_not_allowed"
    assert len(r.headers["x-capyctl-request-id"]) == 26


def test_ulids_encode_time_and_randomness_in_crockford_base32() -> None:
    from capyctl_gateway._ulid import new_ulid

    alphabet = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    for ms in (0, 1, 1796000000123, 2**48 - 1):
        rid = new_ulid(ms)
        assert len(rid) == 26 and set(rid) <= set(alphabet)
        assert ulid_ms(rid) == ms
    assert new_ulid(0)[:10] == "0000000000"
    assert new_ulid(2**48 - 1)[:10] == "7ZZZZZZZZZ"
    ids = {new_ulid(5) for _ in range(1000)}
    assert len(ids) == 1000  # 80 random bits each
    assert {i[:10] for i in ids} == {"0000000005"}  # the time is the first 10 digits
