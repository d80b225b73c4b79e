"""A host's ingress at its connection cap, in front of a server on uvloop (as ``serve`` runs
it), the ingress on an event loop of its own (as on its own machine): every request it refuses
for lack of room fails over to the other host, none is lost as 502."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator

import pytest
from aiohttp import web

from capyctl_gateway._cli_common import bind
from capyctl_gateway._cli_machines import ingress_runner
from capyctl_gateway._host import Host, join
from tests.gateway.machines.test_machines import Cluster, cluster, dep
from tests.gateway.machines.test_machines_payloads import HashingEngine, hashing

__all__ = ["cluster", "hashing"]

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})


@contextlib.contextmanager
def full_ingress(cap: int) -> Iterator[tuple[str, int]]:
    """An ingress on a thread and event loop of its own, its ``cap`` connections taken by
    clients in the middle of a request head: its host and port."""
    ready: list[tuple[str, int]] = []
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def main() -> None:
        runner = ingress_runner(dict, lambda: None, cap)
        await runner.setup()
        sock = bind("127.0.0.1", 0)
        await web.SockSite(runner, sock).start()
        port = int(sock.getsockname()[1])
        held = []
        for _ in range(cap):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /i/x/0/v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            held.append(writer)
        ready.append(("127.0.0.1", port))
        started.set()
        await stop.wait()
        for writer in held:
            writer.close()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),))
    thread.start()
    try:
        assert started.wait(10)
        yield ready[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


async def test_requests_offered_to_a_full_ingress_fail_over_to_the_other_host(
    cluster: Callable[..., Awaitable[Cluster]],
    hashing: Callable[[], Awaitable[HashingEngine]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = await hashing(), await hashing()
    c = await cluster([dep({"host": "box-a", "url": a.url}, {"host": "box-b", "url": b.url})])
    await c.start_host("box-b")
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 1_000_000}]}
    caplog.set_level("INFO", "capyctl_gateway")
    with full_ingress(2) as (host, port):
        state = c.tmp / "host-box-a"
        await join(c.join_file("box-a"), state)
        box_a = Host(state, f"http://{host}:{port}")
        session = asyncio.get_running_loop().create_task(box_a.run())
        try:
            await asyncio.wait_for(box_a.connected.wait(), 10)
            async with c.client() as client:
                answers = [await client.post("/v1/chat/completions", json=body) for _ in range(8)]
        finally:
            session.cancel()
            await asyncio.gather(session, return_exceptions=True)
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
    assert a.digests == [] and len(b.digests) == 8
    failovers = [getattr(r, "fields", {}) for r in caplog.records
                 if getattr(r, "event", "") == "router_failover"]  # fmt: skip
    assert failovers and all(f["host"] == "box-a" for f in failovers)  # box-a was offered some
