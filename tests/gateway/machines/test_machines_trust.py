"""What the server and a host's ingress trust, over real loopback sockets: an ingress address a
host announces must be on the address its session comes from; a request to the ingress without
a valid gate key learns nothing of which instances are there."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest

from capyctl_gateway._host import Host, join
from capyctl_gateway._machines.protocol import NOT_FORWARDED, deployment_tag, ingress_path
from tests.eventually import eventually
from tests.gateway.conftest import KEY
from tests.gateway.fake_engine import FakeEngine
from tests.gateway.machines.test_machines import Cluster, cluster, dep, engines, reported

__all__ = ["cluster", "engines"]

pytestmark = pytest.mark.anyio


async def logged(caplog: pytest.LogCaptureFixture, text: str, within: float = 10) -> str:
    """The first log line with ``text``, once it is there."""
    lines = await eventually(
        lambda: [r.getMessage() for r in caplog.records if text in r.getMessage()], within=within
    )
    return lines[0]


async def test_the_server_refuses_an_ingress_that_is_not_on_the_hosts_own_address(
    cluster: Callable[..., Awaitable[Cluster]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "capyctl_gateway")
    c = await cluster([dep({"host": "gpu-box", "url": "http://127.0.0.1:9"})])
    state = c.tmp / "host-gpu-box"
    await join(c.join_file("gpu-box"), state)
    # Its session comes from 127.0.0.1; it points the server at 127.0.0.2 (another machine's
    # address, or the server's own loopback, as far as the server can tell).
    host = Host(state, "http://127.0.0.2:8443")
    task = asyncio.get_running_loop().create_task(host.run())
    try:
        line = await logged(caplog, "is not on the address its session comes from")
        assert "host gpu-box: its ingress http://127.0.0.2:8443 " in line
        assert "(127.0.0.1); session refused" in line
        gw = c.gateway
        assert gw.fleet.machines is not None
        assert gw.fleet.machines.sessions == {} and not host.connected.is_set()
        assert not any("session up" in r.getMessage() for r in caplog.records)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize(
    ("ingress", "peer", "ok"),
    [
        ("http://10.0.0.21:8444", "10.0.0.21", True),
        ("http://10.0.0.21:8444", "::ffff:10.0.0.21", True),  # a dual-stack listener's view
        ("http://[fd00::21]:8444", "fd00::21", True),
        ("http://127.0.0.1:8443", "10.0.0.21", False),  # the server's own loopback
        ("http://10.0.0.22:8444", "10.0.0.21", False),  # another machine
        ("http://10.0.0.21:8444", None, False),
    ],
)
def test_an_ingress_is_trusted_only_on_the_address_the_session_comes_from(
    ingress: str, peer: str | None, ok: bool
) -> None:
    from capyctl_gateway._machines.control import on_host

    assert on_host(ingress, peer) is ok


async def test_the_ingress_answers_401_before_it_looks_up_the_path(
    cluster: Callable[..., Awaitable[Cluster]], engines: Callable[[], Awaitable[FakeEngine]]
) -> None:
    engine = await engines()
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    host = await c.start_host("gpu-box")
    await reported(c, lambda i, r: r.gate is not None)
    gate = host.gate(deployment_tag("m"), 0)
    assert gate is not None and gate.key is not None
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    paths = [  # an instance that is there, and three that are not
        ingress_path("m", 0) + "/v1/chat/completions",
        ingress_path("m", 7) + "/v1/chat/completions",
        ingress_path("no-such-deployment", 0) + "/v1/chat/completions",
        ingress_path("m", 0) + "/v1/models",
    ]
    keys = [{}, {"Authorization": "Bearer " + "0" * 64}, {"Authorization": f"Bearer {KEY}"}]
    async with httpx.AsyncClient() as client:
        for path in paths:  # the same answer for each: nothing tells which names exist
            for headers in keys:
                r = await client.post(host.ingress_url + path, json=body, headers=headers)
                assert r.status_code == 401, (path, r.status_code)
                assert r.headers[NOT_FORWARDED] == "unauthorized"
        auth = {"Authorization": f"Bearer {gate.key}"}
        r = await client.post(host.ingress_url + paths[1], json=body, headers=auth)
        assert r.status_code == 404  # the server, which holds a key, learns what is missing
    assert engine.received == []


async def test_a_restarted_server_keeps_counting_the_cuts_of_an_engine_its_host_kept_running(
    cluster: Callable[..., Awaitable[Cluster]],
) -> None:
    from capyctl_gateway._deployments.settle import CutRequest, SettleRule
    from capyctl_gateway._store import Store
    from tests.gateway.lifecycle.test_lifecycle import ENGINE

    launch = {"command": [*ENGINE, "--served", "tiny"], "startup_timeout": "60s"}
    c = await cluster([dep({"host": "gpu-box", "launch": launch})])
    host = await c.start_host("gpu-box")
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    async with c.client() as client:
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    gw = c.gateway
    key = gw.fleet.routes["m"].instances[0].key
    await c.stop_server()
    # What the stopped server left: a request cut on the engine its host keeps running.
    store = Store(c.server_state / "gateway.sqlite3")
    cut = CutRequest("01CUTBEFORETHERESTART00000", time.time(), SettleRule.AT_RESTART, "hang-up")
    store.add_cut(key, cut)
    store.close()
    host.connected.clear()
    await c.start_server()
    gw = c.gateway
    await asyncio.wait_for(host.connected.wait(), 15)
    inst = gw.fleet.routes["m"].instances[0]
    for _ in range(2):  # reports of the engine still running, the same process: nothing settles
        await reported(c, lambda i, r: r.state == "ready" and r.gate is not None)
    assert [c.request_id for c in inst.ledger.cut] == [cut.request_id]
    assert host.placed.fleet is not None
    process = host.placed.fleet.lifecycle.lives["m"].launched[0].inst.runner.process()
    assert process is not None and process.pid is not None
    os.kill(process.pid, signal.SIGKILL)  # the engine stops on its host: the host reports it
    await reported(c, lambda i, r: r.state in ("stopped", "failed") or r.pid != process.pid)
    assert inst.ledger.cut == []
