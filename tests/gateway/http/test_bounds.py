"""Every bound of the listener reached over real sockets: malformed HTTP, slow heads, the
connection cap, bodies in flight, slow bodies, oversized answers and clients that stop reading."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import pytest

from capyctl_gateway._config.bounds import Limits
from capyctl_gateway._http.body import client_of
from tests.eventually import eventually
from tests.gateway.conftest import KEY, Gw, deployments
from tests.gateway.fake_engine import FakeEngine, Hold, chunk, event, vllm_stream

pytestmark = pytest.mark.anyio
CHAT: dict[str, Any] = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}]}
MakeGateway = Callable[..., Awaitable[Gw]]


def config(engine: FakeEngine, **limits: Any) -> dict[str, Any]:
    return {"limits": limits, "deployments": [deployments(engine.url)]}


async def raw_exchange(gw: Gw, data: bytes, *, within: float = 10) -> bytes:
    """Send ``data`` on a fresh connection; read one answer (by its Content-Length), or
    whatever comes until the gateway closes the connection."""
    parts = urlsplit(gw.url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(data)
        await writer.drain()
        with anyio.fail_after(within):
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                return exc.partial  # closed before a whole head
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            return head + await reader.readexactly(length)
    finally:
        writer.close()


def split_answer(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, body


def chat_head(body: bytes, *, extra: str = "", length: int | None = None) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: "
        f"{len(body) if length is None else length}\r\n{extra}\r\n"
    ).encode() + body


# -- not valid HTTP ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "auth",
    [
        b"Bearer " + KEY.encode() + b"\x00",
        b"Bearer " + KEY.encode() + b"\rX",
        b"Bearer " + KEY.encode() + b"x" * 9000,
    ],
    ids=["nul", "bare-cr", "over-8190"],
)
async def test_a_malformed_header_gets_the_json_error_and_the_key_never_reaches_the_log(
    gateway: Gw, engine: FakeEngine, caplog: pytest.LogCaptureFixture, auth: bytes
) -> None:
    caplog.set_level(logging.DEBUG)
    request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: " + auth
    request += b"\r\nContent-Length: 2\r\n\r\n{}"
    status, headers, body = split_answer(await raw_exchange(gateway, request))
    assert status == 400
    assert json.loads(body)["code"] == "invalid_request"
    assert headers["x-capyctl-request-id"]
    logged = caplog.text + "".join(str(r.exc_info) for r in caplog.records)
    assert KEY not in logged
    assert engine.received == []


async def test_a_flood_of_malformed_requests_logs_a_few_lines(
    gateway: Gw, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    bad = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \x00\r\n\r\n"
    for _ in range(50):
        assert split_answer(await raw_exchange(gateway, bad))[0] == 400
    assert len([r for r in caplog.records if "not valid HTTP" in r.getMessage()]) <= 3


# -- slow heads, too many connections ----------------------------------------------------------
async def test_a_head_that_never_completes_is_closed(
    engine: FakeEngine, make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await make_gateway(config(engine, header_timeout="300ms"))
    answer = await raw_exchange(gw, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    assert answer == b""  # closed without a word: there was no request to answer
    assert any("header_timeout" in r.getMessage() for r in caplog.records)


async def test_connections_past_the_cap_get_a_503_and_are_closed(
    engine: FakeEngine, make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await make_gateway(config(engine, max_connections=3))
    parts = urlsplit(gw.url)
    held = [await asyncio.open_connection(parts.hostname, parts.port) for _ in range(3)]
    try:
        status, headers, body = split_answer(await raw_exchange(gw, b""))
        assert status == 503
        assert json.loads(body) == {
            "code": "unavailable",
            "message": "the gateway has as many connections as it takes; retry shortly",
            "retryable": True,
        }
        assert headers["x-capyctl-request-id"] and headers["retry-after"] == "1"
        assert any("max_connections" in r.getMessage() for r in caplog.records)
    finally:
        for _, writer in held:
            writer.close()
    engine.script = vllm_stream()
    with anyio.fail_after(10):
        while True:  # the held connections' ends reach the gateway; then it serves again
            async with gw.client() as c:
                r = await c.post("/v1/chat/completions", json=CHAT)
            if r.status_code == 200:
                break
            assert r.status_code == 503


# -- bodies ---------------------------------------------------------------------------------------
async def test_bodies_past_the_bytes_in_flight_are_refused_and_the_count_returns_to_zero(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    engine.script = [event(chunk(delta={"role": "assistant", "content": ""})), Hold()]
    limits = {"max_body_bytes": 2500, "max_decision_body_bytes": 1024}
    gw = await make_gateway(config(engine, max_body_bytes_in_flight=3000, **limits))
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
    async with gw.client() as c, anyio.create_task_group() as tg:
        first: list[Any] = []

        async def hold() -> None:
            first.append(await c.post("/v1/chat/completions", json={**big, "stream": True}))

        tg.start_soon(hold)
        with anyio.fail_after(5):
            await engine.arrived.wait()
        assert gw.gateway.bodies.held > 2000  # the first body is held while it runs
        second = await c.post("/v1/chat/completions", json=big)
        assert (second.status_code, second.json()["code"]) == (503, "unavailable")
        assert second.json()["retryable"] is True
        assert "max_body_bytes_in_flight" in second.json()["message"]
        tg.cancel_scope.cancel()  # the first client hangs up
    with anyio.fail_after(5):
        await engine.hung_up.wait()
    # The gateway closed the engine connection and released the body in one unwinding of the
    # cancelled handler, before the engine could see the close.
    assert gw.gateway.bodies.held == 0
    assert len(engine.received) == 1


def test_a_clients_share_of_the_body_budget_is_half_and_holds_the_largest_body() -> None:
    mib = 2**20
    assert Limits().client_share == 128 * mib  # half of 256 MiB
    assert Limits(max_body_bytes_in_flight=100 * mib).client_share == 64 * mib  # one body
    assert Limits(max_body_bytes_per_client=80 * mib).client_share == 80 * mib
    assert Limits(max_body_bytes_in_flight=512 * mib).client_share == 256 * mib
    with pytest.raises(ValueError, match="max_body_bytes_per_client .* could never be read"):
        Limits(max_body_bytes_per_client=32 * mib)


@pytest.mark.parametrize(
    ("peer", "client"),
    [
        ("203.0.113.7", "203.0.113.7"),
        ("2001:db8:1:2:aaaa::1", "2001:0db8:0001:0002"),  # one host's /64, one client
        ("2001:db8:1:2:bbbb::9", "2001:0db8:0001:0002"),
        ("::ffff:203.0.113.7", "203.0.113.7"),
        (None, ""),
    ],
)
def test_a_client_is_its_address_or_its_ipv6_64(peer: str | None, client: str) -> None:
    assert client_of(peer) == client


async def test_one_client_holds_at_most_its_share_of_the_body_budget_and_another_gets_in(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    """Issue 42, item 15: one client's bodies (four real 64 MiB ones at the defaults) took the
    whole budget, and every other client got 503 until they were done. One address holds at
    most its share (half the budget by default); another still gets in."""
    engine.script = [event(chunk(delta={"role": "assistant", "content": ""})), Hold()]
    limits = {"max_body_bytes": 2500, "max_decision_body_bytes": 1024}
    gw = await make_gateway(config(engine, max_body_bytes_in_flight=6000, **limits))
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}], "stream": True}
    other = httpx.AsyncHTTPTransport(local_address="127.0.0.2")  # another client's address
    async with (
        gw.client() as c,
        gw.client(transport=other) as d,
        anyio.create_task_group() as tg,
    ):

        async def opened(client: httpx.AsyncClient) -> tuple[int, Any]:
            """A stream's status once its head arrives (kept open while it runs), and the
            body of a refusal."""
            head: list[tuple[int, Any]] = []
            arrived = anyio.Event()

            async def run() -> None:
                async with client.stream("POST", "/v1/chat/completions", json=big) as r:
                    refused = None if r.status_code == 200 else json.loads(await r.aread())
                    head.append((r.status_code, refused))
                    arrived.set()
                    await anyio.sleep_forever()

            tg.start_soon(run)
            with anyio.fail_after(5):
                await arrived.wait()
            return head[0]

        first, second, third = [await opened(c) for _ in range(3)]
        assert first == (200, None)
        assert [second[0], third[0]] == [503, 503]  # before: 200, the budget's rest taken
        for _, refused in (second, third):
            assert (refused["code"], refused["retryable"]) == ("unavailable", True)
            assert "limits.max_body_bytes_per_client" in refused["message"]
        assert gw.gateway.bodies.held > 2000  # the first body is held while it runs
        assert (await opened(d))[0] == 200  # another client: before, 503 (the budget full)
        tg.cancel_scope.cancel()
    assert await eventually(lambda: gw.gateway.bodies.held == 0)
    assert len(engine.received) == 2


@pytest.mark.parametrize("workers", [1, 2], ids=["one", "workers2"])
async def test_bodies_declared_large_and_never_sent_lock_nobody_out(
    engine: FakeEngine, make_gateway: MakeGateway, workers: int
) -> None:
    """Four connections that declare 64 MiB bodies and send nine bytes each: the budget (256 MiB)
    was reserved from the declared lengths, and every other request got 503 until they gave up;
    with two workers, whose shares are half of it, the same (issue 34, item 1). What a body holds
    is what arrived."""
    engine.script = vllm_stream()
    gw = await make_gateway(config(engine))  # the defaults: 64 MiB a body, 256 MiB in flight
    parts = urlsplit(gw.url)
    idle = []
    try:
        for _ in range(4):
            reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
            writer.write(chat_head(b'{"model":', length=64 * 1024 * 1024))
            await writer.drain()
            idle.append((reader, writer))
        async with gw.client() as c:
            answers = await asyncio.gather(
                *(c.post("/v1/chat/completions", json=CHAT) for _ in range(20))
            )
        assert [r.status_code for r in answers] == [200] * 20, answers[0].text
        if workers == 1:  # the four hold what they sent, and only that (the 20 released theirs)
            assert await eventually(lambda: gw.gateway.bodies.held == 4 * len(b'{"model":'))
    finally:
        for _, writer in idle:
            writer.close()
    if workers == 1:
        assert await eventually(lambda: gw.gateway.bodies.held == 0)


async def test_a_body_that_stops_arriving_gets_408(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway(config(engine, body_read_timeout="300ms"))
    status, headers, body = split_answer(
        await raw_exchange(gw, chat_head(b'{"model": "my-mo', length=500))
    )
    assert status == 408
    assert json.loads(body)["code"] == "request_timeout"
    assert headers["x-capyctl-request-id"]
    assert engine.received == [] and gw.gateway.bodies.held == 0


# -- answers ----------------------------------------------------------------------------------------
async def test_an_assembled_answer_past_its_cap_is_an_engine_error(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    engine.script = [
        *vllm_stream(["y" * 500] * 10)[:-1],  # 5,000 bytes of text, then never [DONE]
        Hold(),
    ]
    gw = await make_gateway(config(engine, max_answer_bytes=2048))
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert (r.status_code, r.json()["code"]) == (502, "engine_error")
    assert "2048 bytes" in r.json()["message"]
    with anyio.fail_after(5):
        await engine.hung_up.wait()  # the engine connection was closed: it stops


async def test_a_client_that_stops_reading_is_a_hang_up_at_the_idle_timeout(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    text = "z" * 4000
    engine.script = [event(chunk(delta={"content": text})) for _ in range(4000)]  # ~16 MB
    gw = await make_gateway(
        {"queue": {"stream_idle_timeout": "500ms"}, "deployments": [deployments(engine.url)]}
    )
    parts = urlsplit(gw.url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
    sock.connect((parts.hostname, parts.port))
    body = json.dumps({**CHAT, "stream": True}).encode()
    sock.sendall(chat_head(body))
    try:
        with anyio.fail_after(15):
            await engine.hung_up.wait()  # never read a byte: the gateway gave up on us
        cut = gw.gateway.fleet.settlement.ledgers["my-model/0"].cut
        assert [c.reason for c in cut] == ["hang_up"]
        assert gw.gateway.fleet.routes["my-model"].queue.running == 0
    finally:
        sock.close()
