"""Streams relayed from the engine connection's reads (`_relay/pump.py`), over real sockets.

The engine here sends each event only once the client has received the one before it, so
every event after the first is a read of its own, taken by the pump: the same bytes, verdicts
and connection fates as the task's loop are required of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
import pytest
from aiohttp import web

from capyctl_gateway._cli_common import bind
from capyctl_gateway._engine_answer import HIGH_WATER, Body
from capyctl_gateway._relay import pump
from capyctl_gateway._relay.chat import start_stream
from tests.gateway.conftest import Gw, deployments
from tests.gateway.fake_engine import (
    DONE,
    Drop,
    FakeEngine,
    Flood,
    Gate,
    Hold,
    Item,
    Pause,
    chunk,
    event,
)

pytestmark = pytest.mark.anyio
CHAT = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
ROLE = event(chunk(delta={"role": "assistant", "content": ""}))
FINISH = event(chunk(delta={}, finish="stop"))
USAGE = event(chunk(choices=[], usage={"prompt_tokens": 2, "completion_tokens": 9}))


def gated(items: list[bytes]) -> tuple[list[Item], list[asyncio.Event]]:
    """``items`` with a gate before each but the first: the engine writes the next once its
    gate is opened."""
    gates = [asyncio.Event() for _ in items[1:]]
    script: list[Item] = [items[0]]
    for gate, item in zip(gates, items[1:], strict=True):
        script += [Gate(gate), item]
    return script, gates


async def lockstep(gw: Gw, gates: list[asyncio.Event]) -> tuple[int, list[str]]:
    """Stream a chat answer, opening the engine's next gate on each data event received;
    returns the status and every line."""
    lines: list[str] = []
    opened = 0
    async with (
        gw.client() as c,
        c.stream("POST", "/v1/chat/completions", json=CHAT) as r,
    ):
        with anyio.fail_after(10):
            async for line in r.aiter_lines():
                lines.append(line)
                if line.startswith("data: ") and opened < len(gates):
                    gates[opened].set()
                    opened += 1
    return r.status_code, lines


def data(lines: list[str]) -> list[Any]:
    return [
        "[DONE]" if line == "data: [DONE]" else orjson.loads(line[6:])
        for line in lines
        if line.startswith("data: ")
    ]


def texts(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content", "")
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


async def test_events_read_one_at_a_time_are_relayed_whole_and_the_connection_pooled(
    gateway: Gw, engine: FakeEngine
) -> None:
    words = [f"w{i} " for i in range(40)]
    items = [ROLE, *(event(chunk(delta={"content": w})) for w in words), FINISH, USAGE, DONE]
    for _ in range(2):  # the second answer comes on the connection the first left in the pool
        engine.script, gates = gated(items)
        # The chunked body's end in a read after [DONE], as uvicorn sends it: the connection
        # is read on after the stream's end, and pooled.
        end = asyncio.Event()
        engine.script.append(Gate(end))
        gates.append(end)
        status, lines = await lockstep(gateway, gates)
        assert status == 200
        events = data(lines)
        assert events[-1] == "[DONE]"
        assert texts(events) == "".join(words)
        assert {e["model"] for e in events[:-1]} == {"my-model"}
        assert events[-2]["usage"]["completion_tokens"] == 9
        assert any(line.startswith(": x-capyctl-metrics ") for line in lines)
        await asyncio.gather(*gateway.gateway.fleet.drains)
    assert len({r.peer for r in engine.received}) == 1


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(b"data: {not json\n\n", id="malformed"),
        pytest.param(event(chunk(delta={"content": "b"}, cid="other")), id="changing-id"),
        pytest.param(event(chunk(delta={"content": "b", "citations": []})), id="unknown-key"),
        pytest.param(DONE, id="done-before-finish"),
    ],
)
async def test_a_fault_in_a_later_read_ends_the_stream_unverified_and_closes_the_engine(
    gateway: Gw, engine: FakeEngine, fault: bytes
) -> None:
    items = [ROLE, event(chunk(delta={"content": "a"})), fault, FINISH, DONE]
    engine.script, gates = gated(items)
    engine.script.append(Hold())  # were the connection kept, the engine would wait here
    status, lines = await lockstep(gateway, gates)
    assert status == 200
    events = data(lines)
    assert texts(events) == "a"  # what came before the fault was relayed
    assert events[-1]["error"]["code"] == "stream_unverified"
    assert "[DONE]" not in events
    with anyio.fail_after(5):
        await engine.hung_up.wait()
    assert gateway.gateway.fleet.routes["my-model"].queue.running == 0


@pytest.mark.parametrize("end", ["body-ends", "connection-dropped"])
async def test_an_answer_that_stops_short_in_a_later_read_is_an_in_band_error(
    gateway: Gw, engine: FakeEngine, end: str
) -> None:
    items = [ROLE, event(chunk(delta={"content": "a"})), event(chunk(delta={"content": "b"}))]
    engine.script, gates = gated(items)
    if end == "connection-dropped":
        engine.script.append(Drop())
    status, lines = await lockstep(gateway, gates)
    assert status == 200
    events = data(lines)
    assert texts(events) == "ab"
    error = events[-1]["error"]
    if end == "body-ends":
        assert error["code"] == "stream_unverified"
        assert error["message"].endswith("the engine stream ended without [DONE]")
    else:
        assert error["code"] == "engine_error"
    assert "127.0.0.1" not in lines[-1]  # the engine's address stays inside
    assert gateway.gateway.fleet.routes["my-model"].queue.running == 0


ITEM = event(chunk(delta={"content": "z" * 16_000}))
FLOOD_LIMIT = 4096  # 64 MB: well past what the sockets' buffers hold


async def test_a_client_that_falls_behind_holds_the_engine_back_and_then_gets_everything(
    engine: FakeEngine, make_gateway: Callable[..., Awaitable[Gw]]
) -> None:
    gw = await make_gateway({"deployments": [deployments(engine.url)]})
    stalled, first = asyncio.Event(), asyncio.Event()
    flood = Flood(ITEM, stalled, limit=FLOOD_LIMIT)
    engine.script = [ROLE, Gate(first), event(chunk(delta={"content": "a"})), flood]
    engine.script += [event(chunk(delta={"content": "b"})), FINISH, DONE]
    body = ""
    async with (
        gw.client() as c,
        c.stream("POST", "/v1/chat/completions", json=CHAT) as r,
    ):
        lines = r.aiter_lines()
        with anyio.fail_after(30):
            async for line in lines:
                first.set()
                if '"a"' in line:
                    break
            # The client reads nothing now: the gateway's writes back up, so it must stop
            # reading the engine, whose writes then back up in turn.
            await stalled.wait()
            assert flood.written[0] < FLOOD_LIMIT // 2  # the gateway did not take it all
            async for line in lines:
                if line == "data: [DONE]":
                    body += "<done>"
                elif line.startswith("data: "):
                    body += texts([orjson.loads(line[6:])])
    assert body == "z" * 16_000 * flood.written[0] + "b<done>"


async def test_a_client_that_stops_reading_while_events_are_pumped_is_a_hang_up(
    engine: FakeEngine, make_gateway: Callable[..., Awaitable[Gw]]
) -> None:
    config = {"queue": {"stream_idle_timeout": "500ms"}, "deployments": [deployments(engine.url)]}
    gw = await make_gateway(config)
    first = asyncio.Event()
    flood = Flood(ITEM, asyncio.Event(), limit=FLOOD_LIMIT)
    engine.script = [ROLE, Gate(first), event(chunk(delta={"content": "a"})), flood, Hold()]
    async with (
        gw.client() as c,
        c.stream("POST", "/v1/chat/completions", json=CHAT) as r,
    ):
        lines = r.aiter_lines()  # kept: a generator dropped would close the response
        with anyio.fail_after(30):
            async for line in lines:
                first.set()
                if '"a"' in line:
                    break
            # Never read again. A gateway that kept reading the engine would hold the whole
            # flood and then see a quiet stream (idle_timeout); one that stopped was writing
            # to a client that did not read when the deadline came (hang_up).
            await engine.hung_up.wait()
    cut = gw.gateway.fleet.settlement.ledgers["my-model/0"].cut
    assert [c.reason for c in cut] == ["hang_up"]
    assert flood.written[0] < FLOOD_LIMIT // 2


async def test_a_client_that_hangs_up_while_events_are_pumped_stops_the_engine(
    gateway: Gw, engine: FakeEngine
) -> None:
    items = [ROLE, event(chunk(delta={"content": "a"})), event(chunk(delta={"content": "b"}))]
    engine.script, gates = gated(items)
    engine.script.append(Hold())
    async with (
        gateway.client() as c,
        c.stream("POST", "/v1/chat/completions", json=CHAT) as r,
    ):
        seen = 0
        with anyio.fail_after(10):
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen <= len(gates):
                        gates[seen - 1].set()
                    if '"b"' in line:
                        break  # leave: the client closes its connection
    with anyio.fail_after(5):
        await engine.hung_up.wait()
    assert engine.finished == 0


# -- a client that asked for no stream: the answer folded read by read --------------------------
async def fold(gw: Gw) -> tuple[int, Any]:
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": False})
        return r.status_code, r.json()


def paced(items: list[bytes]) -> list[Item]:
    """``items`` with the engine slow between them (each a read of its own, most likely)."""
    script: list[Item] = []
    for item in items:
        script += [item, Pause(0.01)]
    return script


async def test_an_answer_read_by_read_is_folded_whole_and_the_connection_pooled(
    gateway: Gw, engine: FakeEngine
) -> None:
    words = [f"w{i} " for i in range(10)]
    engine.script = paced(
        [ROLE, *(event(chunk(delta={"content": w})) for w in words), FINISH, USAGE, DONE]
    )
    for _ in range(2):
        status, body = await fold(gateway)
        assert status == 200
        assert body["choices"][0]["message"]["content"] == "".join(words)
        assert body["model"] == "my-model" and body["usage"]["completion_tokens"] == 9
        await asyncio.gather(*gateway.gateway.fleet.drains)
    assert len({r.peer for r in engine.received}) == 1


async def test_an_answer_is_given_at_done_though_the_body_never_ends(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = [*paced([ROLE, event(chunk(delta={"content": "a"})), FINISH, DONE]), Hold()]
    with anyio.fail_after(5):  # not at the stream's idle timeout
        status, body = await fold(gateway)
    assert status == 200 and body["choices"][0]["message"]["content"] == "a"
    with anyio.fail_after(5):
        await engine.hung_up.wait()  # the body's end never came: closed, not pooled


@pytest.mark.parametrize(
    "end",
    [
        pytest.param([b"data: {not json\n\n", FINISH, DONE, Hold()], id="malformed"),
        pytest.param([FINISH], id="body-ends"),
        pytest.param([Drop()], id="connection-dropped"),
    ],
)
async def test_an_answer_that_fails_in_a_later_read_is_a_502_and_the_engine_is_let_go(
    gateway: Gw, engine: FakeEngine, end: list[Item]
) -> None:
    engine.script = [*paced([ROLE, event(chunk(delta={"content": "a"}))]), *end]
    status, body = await fold(gateway)
    assert (status, body["code"]) == (502, "engine_error")
    assert "127.0.0.1" not in str(body)
    if isinstance(end[-1], Hold):
        with anyio.fail_after(5):
            await engine.hung_up.wait()
    assert gateway.gateway.fleet.routes["my-model"].queue.running == 0


async def test_an_answer_past_its_cap_in_a_later_read_is_refused_and_the_engine_let_go(
    engine: FakeEngine, make_gateway: Callable[..., Awaitable[Gw]]
) -> None:
    gw = await make_gateway(
        {"limits": {"max_answer_bytes": 20_000}, "deployments": [deployments(engine.url)]}
    )
    big = event(chunk(delta={"content": "y" * 6_000}))
    engine.script = [*paced([ROLE, big, big, big, big]), Hold()]
    status, body = await fold(gw)
    assert (status, body["code"]) == (502, "engine_error")
    assert "over 20000 bytes" in body["message"]
    with anyio.fail_after(5):
        await engine.hung_up.wait()


class _Socket:
    """The connection side of a `Body`: whether its socket is being read."""

    def __init__(self) -> None:
        self._reading = True
        self.body: Body

    def reading(self) -> bool:
        return self._reading

    def pause(self) -> None:
        self._reading = False

    def resume(self) -> None:
        self._reading = True

    def done(self, *, reuse: bool) -> None:
        pass


def test_a_pump_attached_to_a_body_gets_what_was_buffered_first_and_reading_resumes() -> None:
    sock = _Socket()
    body = Body(sock)
    body.feed_all([b"a", b"b"])
    body.feed_all([b"x" * HIGH_WATER])  # past the bound: the socket is no longer read
    assert not sock.reading()
    got: list[bytes] = []
    body.attach(lambda parts: got.append(b"".join(parts)))
    assert got == [b"ab" + b"x" * HIGH_WATER] and sock.reading()
    body.feed_all([b"c", b"d"])
    body.hand_over()
    assert got[-1] == b"cd" and not sock.reading()
    body.detach()
    assert sock.reading()
    body.feed_all([b"e"])
    assert got[-1] == b"cd"  # back to the buffer


# -- the pump's writes are aiohttp's bytes --------------------------------------------------------
@pytest.mark.parametrize("version", ["1.1", "1.0"])
async def test_the_pump_takes_http_1_1_streams_and_frames_a_chunk_as_aiohttp_does(
    version: str,
) -> None:
    pieces = [b"data: first\n\n", b"x" * 70_000, b"data: last\n\n"]
    seen: list[bool] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        out = await start_stream(request, {})
        seen.append(pump.pumpable(out))
        for piece in pieces:
            await out.write(piece)
        await out.write_eof()
        return out

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.SockSite(runner, bind("127.0.0.1", 0))
    await site.start()
    port = runner.addresses[0][1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET / HTTP/{version}\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        with anyio.fail_after(5):
            raw = await reader.read()
        writer.close()
    finally:
        await runner.cleanup()
    body = raw.partition(b"\r\n\r\n")[2]
    if version == "1.1":
        assert seen == [True]
        assert body == b"".join(map(pump.chunk, pieces)) + b"0\r\n\r\n"
    else:  # no chunked framing: the task's loop writes it
        assert seen == [False]
        assert body == b"".join(pieces)
