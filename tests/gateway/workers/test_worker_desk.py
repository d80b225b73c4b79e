"""A worker's side of the line, against an authority the test speaks for: an abort that comes
with its offer ends the request before anything reaches the engine, and an abort meant for an
instance that never took the request does not follow it to the next. The worker is real (its
listener, its engine client, the fake engine); only the authority's words are the test's."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import TypeVar

import httpx
import pytest

from capyctl_gateway import GatewayConfig
from capyctl_gateway._engine_client import EngineClient
from capyctl_gateway._workers.desk import MAX_URLS, RemoteDesk
from capyctl_gateway._workers.messages import (
    Abort,
    Admit,
    End,
    Hello,
    Message,
    Next,
    Offer,
    Quit,
    Ready,
)
from capyctl_gateway._workers.wire import Wire
from capyctl_gateway._workers.worker import Worker, bound
from tests.gateway.conftest import KEY, deployments
from tests.gateway.fake_engine import FakeEngine, vllm_stream

pytestmark = pytest.mark.anyio
CHAT = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}]}
HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}


M = TypeVar("M", bound=Message)


class Authority:
    """The authority's end of one line, spoken by the test."""

    def __init__(self) -> None:
        self.got: asyncio.Queue[Message] = asyncio.Queue()
        self.wire = Wire(self.got.put_nowait, lambda: None)

    async def next(self, kind: type[M]) -> M:
        while True:
            m = await asyncio.wait_for(self.got.get(), 10)
            if isinstance(m, kind):
                return m


@pytest.fixture
async def worker(engine: FakeEngine) -> AsyncIterator[tuple[Authority, str]]:
    ours, theirs = socket.socketpair()
    authority = Authority()
    loop = asyncio.get_running_loop()
    await loop.create_unix_connection(lambda: authority.wire, sock=ours)
    config = GatewayConfig.model_validate({"deployments": [deployments(engine.url)]})
    hello = {"config": config.model_dump(mode="json"), "key": KEY, "workers": 1, "index": 0}
    authority.wire.send(Hello({**hello, "started_at": 1796000000, "prefix_seed": 7}))
    w = Worker()
    await w.connect(theirs)
    sock = bound("127.0.0.1", 0, reuse_port=True)
    port = sock.getsockname()[1]
    serving = loop.create_task(w.serve(sock))
    await authority.next(Ready)
    try:
        yield authority, f"http://127.0.0.1:{port}"
    finally:
        authority.wire.send(Quit())
        await serving
        await w.close()
        authority.wire.close()


def offer(gid: int, url: str) -> Offer:
    return Offer(gid, 0, f"{url}/v1/chat/completions", HEADERS, "instance 0", False, 0.0, False)


async def test_an_abort_that_comes_with_its_offer_sends_nothing_to_the_engine(
    worker: tuple[Authority, str], engine: FakeEngine
) -> None:
    authority, url = worker
    engine.script = vllm_stream()
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as c:
        asking = asyncio.ensure_future(c.post(f"{url}/v1/chat/completions", json=CHAT))
        gid = (await authority.next(Admit)).gid
        authority.wire.send(offer(gid, engine.url))
        authority.wire.send(Abort(gid, "the gateway is stopping", "shutting_down"))  # one write
        r = await asking
    assert (r.status_code, r.json()["code"], r.json()["retryable"]) == (503, "shutting_down", True)
    end = await authority.next(End)
    assert (end.gid, end.sent) == (gid, False)  # not sent: nothing to settle
    assert engine.received == []


async def test_an_abort_for_an_instance_that_never_took_it_does_not_follow_it(
    worker: tuple[Authority, str], engine: FakeEngine
) -> None:
    authority, url = worker
    engine.script = vllm_stream()
    with socket.socket() as closed:  # a port nothing listens on: connection refused
        closed.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{closed.getsockname()[1]}"
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as c:
        asking = asyncio.ensure_future(c.post(f"{url}/v1/chat/completions", json=CHAT))
        gid = (await authority.next(Admit)).gid
        authority.wire.send(offer(gid, nobody))
        assert (await authority.next(Next)).gid == gid  # never sent there
        # That instance's host is lost just then; the next offer goes elsewhere.
        authority.wire.send(Abort(gid, "host a lost its session", "engine_error"))
        authority.wire.send(offer(gid, engine.url))
        r = await asking
    assert r.status_code == 200, r.text
    end = await authority.next(End)
    assert (end.gid, end.sent, end.completed) == (gid, True, True)  # sent and completed
    assert len(engine.received) == 1


async def test_the_parsed_engine_urls_a_worker_keeps_are_bounded() -> None:
    config = GatewayConfig.model_validate({"deployments": [deployments("http://127.0.0.1:9")]})
    engines = EngineClient(connect_timeout=1)
    desk = RemoteDesk(config, engines, Wire(lambda m: None, lambda: None))
    try:
        for port in range(MAX_URLS + 10):  # hosts that came back on ever new ingress ports
            url = f"http://10.0.0.1:{port + 1}/v1"
            ex = desk._exchange(Offer(0, 0, url, {}, "i", False, None, False), 0.0)
            assert len(desk._urls) <= MAX_URLS
        assert str(ex._url) == f"http://10.0.0.1:{MAX_URLS + 10}/v1"
    finally:
        await engines.close()
