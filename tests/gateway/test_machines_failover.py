"""Several machines when an instance fails: a dead engine behind a live host rests after it
refused a request, instead of being offered every request first; over real loopback sockets."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from capyctl_gateway import GATEWAY_KEY
from capyctl_gateway._deployments.routes import NOT_ACCEPTED_REST_S
from tests.gateway.fake_engine import FakeEngine
from tests.gateway.test_machines import Cluster, cluster, dep, engines, stream

__all__ = ["cluster", "engines"]

pytestmark = pytest.mark.anyio


def _events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    return [getattr(r, "fields", {}) for r in caplog.records if getattr(r, "event", "") == name]


async def test_an_instance_that_refused_a_request_rests_and_is_offered_requests_again_after(
    cluster: Callable[..., Awaitable[Cluster]],
    engines: Callable[[], Awaitable[FakeEngine]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = await engines(), await engines()
    a.script = b.script = stream("ok")
    c = await cluster([dep({"host": "box-a", "url": a.url}, {"host": "box-b", "url": b.url})])
    await c.start_host("box-a")
    await c.start_host("box-b")
    gw = c.app[GATEWAY_KEY] if c.app else None
    assert gw is not None
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
