"""The adversarial tier: generated bodies, headers and engine streams against a gateway on real
sockets. For every input: no 500 from the gateway itself, the documented error shape and a
request ID on every answer, nothing reaching the engine for a refused request, and the
gateway's counts back where they started."""

from __future__ import annotations

import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capyctl_gateway._http.validate import CHAT_FIELDS
from tests.gateway.conftest import Gw, deployments
from tests.gateway.fake_engine import DONE, FakeEngine, Item, chunk, event, vllm_stream

pytestmark = pytest.mark.anyio
SETTINGS = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
fields = st.sampled_from(sorted(CHAT_FIELDS)) | st.text(min_size=1, max_size=12)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["my-model", "llama", "decider", "nope", ""]) | json_values,
        "messages": st.just([{"role": "user", "content": "hi"}]) | json_values,
        "stream": st.booleans() | json_values,
    },
).flatmap(
    lambda base: st.dictionaries(fields, json_values, max_size=4).map(lambda d: {**d, **base})
)


def assert_documented(r: httpx.Response) -> None:
    assert r.status_code != 500, r.text
    assert r.headers.get("x-capyctl-request-id"), r.headers
    if r.status_code != 200:
        doc = r.json()
        assert set(doc) <= {"code", "message", "retryable"} and doc["code"] and doc["message"]


def settled_counts(gw: Gw) -> None:
    for route in gw.gateway.fleet.routes.values():
        assert route.queue.running == 0 and route.queue.waiting == 0
        assert all(i.ledger.running == 0 for i in route.instances)
    assert gw.gateway.bodies.held == 0


async def test_any_body_is_answered_as_documented(gateway: Gw, engine: FakeEngine) -> None:
    engine.script = vllm_stream()

    @SETTINGS
    @given(body=bodies | st.binary(max_size=200).map(lambda b: {"__raw__": b}))
    def check(body: dict[str, Any]) -> None:
        before = len(engine.received)
        raw = body["__raw__"] if "__raw__" in body else json.dumps(body).encode()
        with httpx.Client(base_url=gateway.url, timeout=30) as c:
            r = c.post(
                "/v1/chat/completions",
                content=raw,
                headers={"Authorization": f"Bearer {gateway.key}"},
            )
        assert_documented(r)
        if 400 <= r.status_code < 500:
            assert len(engine.received) == before  # refused: nothing reached the engine

    await anyio.to_thread.run_sync(check)
    settled_counts(gateway)


header_bytes = st.binary(max_size=140).map(lambda b: b.replace(b"\n", b""))


def raw_post(
    gw: Gw, headers: list[tuple[bytes, bytes]], body: bytes
) -> tuple[int, dict[str, str], bytes]:
    """One request with exactly these header bytes, on its own connection."""
    parts = urlsplit(gw.url)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    head += b"".join(k + b": " + v + b"\r\n" for k, v in headers)
    head += b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            more = sock.recv(65536)
            assert more, data
            data += more
        top, _, rest = data.partition(b"\r\n\r\n")
        lines = top.decode("latin-1").split("\r\n")
        fields = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        length = int(fields.get("content-length", "0"))
        while len(rest) < length:
            more = sock.recv(65536)
            assert more
            rest += more
    return int(lines[0].split()[1]), fields, rest


async def test_any_headers_are_answered_as_documented(gateway: Gw, engine: FakeEngine) -> None:
    engine.script = vllm_stream()
    good = f"Bearer {gateway.key}".encode()

    @SETTINGS
    @given(auth=st.none() | header_bytes | st.just(good), ids=st.lists(header_bytes, max_size=2))
    def check(auth: bytes | None, ids: list[bytes]) -> None:
        before = len(engine.received)
        pairs = [(b"X-Request-Id", v) for v in ids]
        if auth is not None:
            pairs.append((b"Authorization", auth))
        status, fields, body = raw_post(gateway, pairs, b'{"model": "my-model", "messages": []}')
        assert status != 500, body
        assert fields.get("x-capyctl-request-id"), fields
        if status != 200:
            doc = orjson.loads(body)
            assert doc["code"] and doc["message"]
            assert len(engine.received) == before
        if auth != good:
            assert status in (400, 401)

    await anyio.to_thread.run_sync(check)
    settled_counts(gateway)


def _mutations(items: list[Item]) -> st.SearchStrategy[list[Item]]:
    at = st.integers(min_value=0, max_value=len(items) - 1)
    junk = st.sampled_from(
        [
            b": ping\n\n",
            b"data: {not json\n\n",
            b"event: x\ndata: {}\n\n",
            event(chunk(delta={"content": 5})),
            event(chunk(delta={"weird": "x"})),
            event(chunk(delta={"content": "x"}, model="other")),
            event(chunk(delta={"content": "x"}, cid="another")),
            event({"error": {"code": 500, "message": "boom at 10.0.0.7"}}),
            event(chunk(delta={"content": "x"}, finish="abort")),
            b"data: " + b"x" * 70000 + b"\n\n",
            DONE,
        ]
    )
    return st.one_of(
        at.map(lambda i: items[:i] + items[i + 1 :]),
        st.tuples(at, junk).map(lambda p: [*items[: p[0]], p[1], *items[p[0] :]]),
        at.map(lambda i: items[:i]),
        st.just(items),
    )


async def test_any_engine_stream_is_answered_as_documented(gateway: Gw, engine: FakeEngine) -> None:
    base = vllm_stream(usage={"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4})

    @SETTINGS
    @given(script=_mutations(base), stream=st.booleans())
    def check(script: list[Item], stream: bool) -> None:
        engine.script = script
        with httpx.Client(base_url=gateway.url, timeout=30) as c:
            r = c.post(
                "/v1/chat/completions",
                json={
                    "model": "my-model",
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream": stream,
                },
                headers={"Authorization": f"Bearer {gateway.key}"},
            )
        assert_documented(r)
        assert "10.0.0.7" not in r.text  # the engine's own words stay in the log
        if stream and r.status_code == 200:
            events = [e for e in r.text.split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "data: [DONE]" or '"error"' in events[-1]

    await anyio.to_thread.run_sync(check)
    settled_counts(gateway)


@pytest.mark.parametrize("workers", [1, 2], ids=["one", "workers2"])
async def test_many_bodies_of_small_values_at_once_are_refused_and_disturb_nobody(
    engine: FakeEngine, make_gateway: Callable[..., Awaitable[Gw]], workers: int
) -> None:
    """Issue 34, item 7, with many connections: bodies past ``max_json_tokens`` from 16
    connections at once beside 32 small requests; each big one 413 unparsed, each small one
    served, nothing of the big ones reaches the engine, and every count returns to zero."""
    engine.script = vllm_stream()
    config = {"limits": {"max_json_tokens": 20_000}, "deployments": [deployments(engine.url)]}
    gw = await make_gateway(config)
    tiny = '{"role": "user", "content": "a"}'
    big = '{"model": "my-model", "messages": [' + ", ".join([tiny] * 5000) + "]}"
    small = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}]}
    answers: list[httpx.Response] = []
    async with gw.client(limits=httpx.Limits(max_connections=64)) as c:

        async def send(**kw: Any) -> None:
            answers.append(await c.post("/v1/chat/completions", **kw))

        async with anyio.create_task_group() as tg:
            for n in range(48):
                if n % 3 == 0:
                    tg.start_soon(lambda: send(content=big))
                else:
                    tg.start_soon(lambda: send(json=small))
    refused = [r for r in answers if r.status_code == 413]
    served = [r for r in answers if r.status_code == 200]
    assert len(refused) == 16 and len(served) == 32, sorted(r.status_code for r in answers)
    assert all(r.json()["code"] == "request_too_large" for r in refused)
    assert len(engine.received) == 32 and all(len(r.body["messages"]) == 1 for r in engine.received)
    assert gw.gateway.bodies.held == 0
    assert all(ledger.charged == 0 for ledger in gw.gateway.fleet.settlement.ledgers.values())
