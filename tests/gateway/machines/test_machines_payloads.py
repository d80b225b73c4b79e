"""Several machines under real payloads, over real loopback sockets: request bodies of every size
up to the ingress's limit reach the engine behind a host byte for byte, streamed as they arrive;
one over the limit, or of no stated length, reaches nothing."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import httpx
import orjson
import pytest
from aiohttp import web

from capyctl_gateway._config import REMOTE_MAX_BODY_BYTES
from capyctl_gateway._machines.protocol import (
    INGRESS_MAX_BODY_BYTES,
    NOT_FORWARDED,
    deployment_tag,
    ingress_path,
)
from tests.gateway.fake_engine import FakeEngine, vllm_stream
from tests.gateway.machines.test_machines import Cluster, _site, cluster, dep, reported

__all__ = ["HashingEngine", "cluster", "gated"]

pytestmark = pytest.mark.anyio


@dataclass
class HashingEngine(FakeEngine):
    """A fake engine that notes the length and SHA-256 of each chat body as it received it, and
    when each request's head reached it (before its body is read)."""

    digests: list[tuple[int, str]] = field(default_factory=list)
    heads: asyncio.Event = field(default_factory=asyncio.Event)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.heads.set()
        raw = await request.read()  # aiohttp keeps it: FakeEngine.chat reads it again
        self.digests.append((len(raw), hashlib.sha256(raw).hexdigest()))
        return await super().chat(request)

    async def decide(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.digests.append((len(raw), hashlib.sha256(raw).hexdigest()))
        return await super().decide(request)


@pytest.fixture
async def hashing() -> AsyncIterator[Callable[[], Awaitable[HashingEngine]]]:
    runners: list[web.AppRunner] = []

    async def make() -> HashingEngine:
        fake = HashingEngine(script=list(vllm_stream(["ok"])))
        app = web.Application(client_max_size=4 * REMOTE_MAX_BODY_BYTES)
        fake.routes(app)
        runner, addr = await _site(web.AppRunner(app, handler_cancellation=True))
        fake.url = f"http://{addr}"
        runners.append(runner)
        return fake

    try:
        yield make
    finally:
        for r in runners:
            await r.cleanup()


def chat_body(size: int) -> bytes:
    """A chat request of exactly ``size`` bytes, its prompt random (so a cut or a swapped piece
    changes the hash)."""
    shell = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": ""}]})
    pad = os.urandom(size).hex()[: size - len(shell)]
    body = shell.replace(b'"content":""', b'"content":"' + pad.encode() + b'"')
    assert len(body) == size
    return body


async def gated(
    cluster: Callable[..., Awaitable[Cluster]], engine: FakeEngine
) -> tuple[Cluster, str, dict[str, str]]:
    """A server and one host in front of ``engine``; the ingress's URL for instance 0 of ``m``
    and the gate key's header, as the server would send them."""
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    host = await c.start_host("gpu-box")
    await reported(c, lambda i, r: r.gate is not None)
    gate = host.gate(deployment_tag("m"), 0)
    assert gate is not None and gate.key is not None
    url = host.ingress_url + ingress_path("m", 0) + "/v1/chat/completions"
    return c, url, {"Authorization": f"Bearer {gate.key}"}


@pytest.mark.parametrize("size", [500_000, 1_000_000, 4_000_000, 8_000_000, INGRESS_MAX_BODY_BYTES])
async def test_the_ingress_forwards_a_body_up_to_its_limit_byte_for_byte(
    cluster: Callable[..., Awaitable[Cluster]],
    hashing: Callable[[], Awaitable[HashingEngine]],
    size: int,
) -> None:
    engine = await hashing()
    _, url, auth = await gated(cluster, engine)
    body = chat_body(size)
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(url, content=body, headers=auth)
    assert r.status_code == 200, r.text
    assert engine.digests == [(size, hashlib.sha256(body).hexdigest())]


async def test_the_ingress_streams_a_body_to_the_engine_as_it_arrives(
    cluster: Callable[..., Awaitable[Cluster]], hashing: Callable[[], Awaitable[HashingEngine]]
) -> None:
    engine = await hashing()
    _, url, auth = await gated(cluster, engine)
    body = chat_body(2_000_000)
    origin, _, path = url.removeprefix("http://").partition("/")
    host, port = origin.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST /{path} HTTP/1.1\r\nHost: {origin}\r\nAuthorization: {auth['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    try:
        writer.write(head.encode() + body[:1_000_000])
        with anyio.fail_after(5):  # the engine has the request while half its body is unsent
            await engine.heads.wait()
        assert engine.digests == []
        writer.write(body[1_000_000:])
        with anyio.fail_after(10):
            status = await reader.readline()
        assert status.startswith(b"HTTP/1.1 200 "), status
    finally:
        writer.close()
    assert engine.digests == [(len(body), hashlib.sha256(body).hexdigest())]


async def test_the_ingress_refuses_a_body_over_its_limit_or_of_no_length_and_forwards_nothing(
    cluster: Callable[..., Awaitable[Cluster]], hashing: Callable[[], Awaitable[HashingEngine]]
) -> None:
    engine = await hashing()
    _, url, auth = await gated(cluster, engine)

    async def pieces() -> AsyncIterator[bytes]:  # no Content-Length: chunked
        yield chat_body(1000)

    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(url, content=chat_body(INGRESS_MAX_BODY_BYTES + 1), headers=auth)
        assert r.status_code == 413 and r.headers[NOT_FORWARDED] == "request_too_large"
        assert r.json()["code"] == "request_too_large"
        r = await client.post(url, content=pieces(), headers=auth)
        assert r.status_code == 411 and r.headers[NOT_FORWARDED] == "length_required"
    assert not engine.heads.is_set() and engine.digests == []


async def test_a_two_megabyte_chat_through_server_and_host_arrives_whole(
    cluster: Callable[..., Awaitable[Cluster]], hashing: Callable[[], Awaitable[HashingEngine]]
) -> None:
    engine = await hashing()
    c, _, _ = await gated(cluster, engine)
    prompt = os.urandom(1_000_000).hex()
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}]}
    async with c.client() as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(engine.received) == 1
    assert engine.received[0].body["messages"][0]["content"] == prompt


def remote_chat(size: int, tail: bytes = b"") -> bytes:
    """A chat request for deployment ``m`` of exactly ``size`` bytes as sent: compact JSON,
    then ``tail`` (whitespace)."""
    shell = b'{"model":"m","messages":[{"role":"user","content":""}]}'
    pad = os.urandom(size).hex()[: size - len(shell) - len(tail)]
    body = shell.replace(b'"content":""', b'"content":"' + pad.encode() + b'"') + tail
    assert len(body) == size
    return body


async def test_the_8_mib_limit_of_a_deployment_on_a_host_is_measured_on_what_the_client_sent(
    cluster: Callable[..., Awaitable[Cluster]], hashing: Callable[[], Awaitable[HashingEngine]]
) -> None:
    engine = await hashing()
    c, _, _ = await gated(cluster, engine)
    compact = remote_chat(REMOTE_MAX_BODY_BYTES)  # the engine's copy is a few bytes longer
    pretty = remote_chat(REMOTE_MAX_BODY_BYTES + 1, tail=b"\n" * 1024)  # its copy is shorter
    # Under 4 MiB as sent; as the engine would get it (1e15 written 1000000000000000.0), over
    # 8 MiB; with fewer values than limits.max_json_tokens.
    shell = b'{"model":"m","messages":[{"role":"user","content":"x"}],"guided_json":'
    grows = shell + b'{"enum":[' + b",".join([b"1e15"] * 460_000) + b"]}}"
    assert len(grows) < REMOTE_MAX_BODY_BYTES // 2
    plain = {"Content-Type": "application/json"}
    async with c.client() as client:
        r = await client.post("/v1/chat/completions", content=compact, headers=plain)
        assert r.status_code == 200, r.text
        r = await client.post("/v1/chat/completions", content=pretty, headers=plain)
        assert r.status_code == 413 and r.json()["code"] == "request_too_large", r.text
        r = await client.post("/v1/chat/completions", content=grows, headers=plain)
        assert r.status_code == 413 and "as the engine would get it" in r.json()["message"]
    assert len(engine.received) == 1  # neither refusal left the server
    sent = orjson.loads(compact)["messages"][0]["content"]
    assert engine.received[0].body["messages"][0]["content"] == sent


async def test_a_decision_with_a_6_mib_image_reaches_the_engine_through_server_and_host_whole(
    cluster: Callable[..., Awaitable[Cluster]], hashing: Callable[[], Awaitable[HashingEngine]]
) -> None:
    from tests.gateway.relay.test_decisions import ASK

    engine = await hashing()
    decider = {"name": "decider", "engine": "tensorfold", "engine_version": "0.6.1",
               "served_model": "tiny", "api": "decisions",
               "instances": [{"host": "gpu-box", "url": engine.url}]}  # fmt: skip
    c = await cluster([decider])
    await c.start_host("gpu-box")
    await reported(c, lambda i, r: r.gate is not None)
    image = "data:image/png;base64," + base64.b64encode(os.urandom(6 * 2**20 * 3 // 4)).decode()
    assert len(image) > 6 * 2**20
    body = {**ASK, "images": [image]}
    async with c.client() as client:
        r = await client.post("/v1/systemone", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "decider"
    sent = orjson.dumps({**body, "model": "tiny"})  # what the server sends: its own name only
    assert engine.digests == [(len(sent), hashlib.sha256(sent).hexdigest())]
