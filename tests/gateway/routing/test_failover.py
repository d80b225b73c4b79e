"""Failover between instances, only while the request provably reached no engine."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.gateway.conftest import WORKERS, Gw, deployments
from tests.gateway.fake_engine import FakeEngine, Reply, vllm_stream

workers = WORKERS


pytestmark = pytest.mark.anyio
CHAT = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}]}
REFUSING = "http://127.0.0.1:9"  # the discard port: nothing listens
MakeGateway = Callable[..., Awaitable[Gw]]


def two_instances(engine_url: str, *, first: str = REFUSING) -> dict[str, object]:
    dep = deployments(engine_url)
    dep["instances"] = [{"url": first}, {"url": engine_url}]
    return {"deployments": [dep]}


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    return [getattr(r, "fields", {}) for r in caplog.records if getattr(r, "event", None) == name]


async def test_a_refused_connection_moves_the_request_to_the_next_instance(
    engine: FakeEngine, make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    engine.script = vllm_stream()
    engine.metrics_served = False  # no fresh sample of either: neither is passed over for it
    gw = await make_gateway(two_instances(engine.url))
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    async with gw.client() as c:
        first = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "f-1"})
        second = await c.post("/v1/chat/completions", json=CHAT)
    assert (first.status_code, second.status_code) == (200, 200)
    assert len(engine.received) == 2
    failovers = events(caplog, "router_failover")
    selections = events(caplog, "router_selection")
    # Every offer to the refusing instance ended in a failover to the other one.
    assert failovers and {f["instance"] for f in failovers} == {0}
    assert all(f["reason"] == "not_accepted" for f in failovers)
    assert len(failovers) == sum(1 for s in selections if s["instance"] == 0)
    assert sum(1 for s in selections if s["instance"] == 1) == 2
    mine = [
        f for f in failovers if f["capyctl_request_id"] == first.headers["x-capyctl-request-id"]
    ]
    assert all(f["caller_request_id"] == "f-1" for f in mine)
    assert gw.gateway.fleet.settlement.ledgers["my-model/0"].charged == 0  # nothing to settle there


async def test_when_no_instance_takes_it_the_answer_is_502(make_gateway: MakeGateway) -> None:
    dep = deployments(REFUSING)
    dep["instances"] = [{"url": REFUSING}, {"url": "http://127.0.0.1:7"}]
    gw = await make_gateway({"deployments": [dep]})
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert (r.status_code, r.json()["code"]) == (502, "engine_error")
    assert "could not be reached" in r.json()["message"]


async def test_an_engine_that_answered_is_never_replayed_elsewhere(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    engine.script = Reply(500, b'{"error": "boom"}')
    gw = await make_gateway(two_instances(engine.url, first=engine.url))  # both this engine
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert (r.status_code, r.json()["code"]) == (502, "engine_error")
    assert len(engine.received) == 1  # answered (with an error): not offered again
