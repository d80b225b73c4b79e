"""Several machines when an instance fails, over real loopback sockets: a dead engine behind a
live host rests after it refused a request, instead of being offered every request first; a
request a partition cut before the engine saw it settles once its host shows the engine idle."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from capyctl_gateway._deployments.routes import NOT_ACCEPTED_REST_S
from capyctl_gateway._deployments.settle import SettleRule
from capyctl_gateway._management.status import deployment_status
from tests.eventually import eventually
from tests.gateway.fake_engine import FakeEngine
from tests.gateway.freezer import Freezer
from tests.gateway.machines.test_machines import (
    Cluster,
    cluster,
    dep,
    engines,
    reported,
    stream,
    two_hosts,
)

__all__ = ["cluster", "engines"]

pytestmark = pytest.mark.anyio


def _events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    return [getattr(r, "fields", {}) for r in caplog.records if getattr(r, "event", "") == name]


async def test_an_instance_that_refused_a_request_rests_and_is_offered_requests_again_after(
    cluster: Callable[..., Awaitable[Cluster]],
    engines: Callable[[], Awaitable[FakeEngine]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    c, a, b = await two_hosts(cluster, engines)
    gw = c.gateway
    # box-a's ingress goes down; its session is still live, so its instance is still open
    await c.hosts["box-a"][2].cleanup()
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    caplog.set_level("INFO", "capyctl_gateway")
    async with c.client() as client:
        for _ in range(30):
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        failed = _events(caplog, "router_failover")
        assert len(failed) == 1 and failed[0]["host"] == "box-a", failed
        picks = _events(caplog, "router_selection")
        assert len(picks) == 31  # 30 requests, one of them offered twice
        rested = [s for p in picks[2:] for s in p["skipped"]]
        assert len(rested) == 29 and all(s["reason"] == "not_accepted_recently" for s in rested)
        assert all(0 < s["rest_left_ms"] <= NOT_ACCEPTED_REST_S * 1000 for s in rested)
        route = gw.fleet.routes["m"]
        later = route.clock() + NOT_ACCEPTED_REST_S
        route.clock = lambda: later  # its rest is over: it is offered a request again
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    assert len(_events(caplog, "router_failover")) == 2
    assert len(b.received) == 31 and a.received == []


async def test_a_request_a_partition_cut_before_the_engine_saw_it_waits_for_its_restart(
    cluster: Callable[..., Awaitable[Cluster]], engines: Callable[[], Awaitable[FakeEngine]]
) -> None:
    """A request cut before its first token on a host's url: engine stays counted until the
    engine's next stop or restart, as on one machine. It settled on a quiet idle report 5 s
    after the ingress's last forward, ordinary hang-ups included (issue 34, item 9a), though
    an engine that never started a request may start it after looking idle."""
    engine = await engines()
    engine.script = stream("ok")
    c = await cluster([dep({"host": "gpu-box", "url": engine.url})])
    links: list[Freezer] = []
    await c.start_host("gpu-box", links)
    await reported(c, lambda i, r: r.gate is not None)
    gw = c.gateway
    ledger = gw.fleet.settlement.ledgers["m/0"]
    for link in links:  # the link goes down before the request leaves the server
        link.freeze()
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    async with c.client() as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 502 and r.json()["code"] == "engine_error", r.text
    assert [cut.rule for cut in ledger.cut] == [SettleRule.AT_RESTART]
    doc = deployment_status(gw.fleet, "m")
    assert doc is not None
    assert doc["instances"][0]["cancelled"][0]["settles"] == SettleRule.AT_RESTART.value
    for link in links:  # the link is back: the host connects again and reports
        link.thaw()
    cut_at = ledger.cut[0].cut_at
    # Idle reports with nothing in flight, the ingress quiet for over 5 s (what settled it
    # before): still counted.
    await reported(
        c,
        lambda i, r: r.quiet_ping is not None and gw.fleet.settlement.now() > cut_at + 6,
        within=20,
    )
    await reported(c, lambda i, r: r.quiet_ping is not None)
    assert len(ledger.cut) == 1 and engine.received == []
    engine.process_start += 100  # the engine restarts: its host's collector sees it
    await eventually(lambda: not ledger.cut)
    assert gw.fleet.settlement.recent[-1].why == "engine restarted on its host"
