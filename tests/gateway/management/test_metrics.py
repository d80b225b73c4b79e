"""GET /metrics on the management listener: the gateway's own series after real traffic,
parsed back with prometheus_client's parser."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import httpx
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from capyctl_gateway import create_management_app
from tests.gateway.conftest import Gw, deployments
from tests.gateway.fake_engine import FakeEngine, Hold, chunk, event, vllm_stream

pytestmark = pytest.mark.anyio
CHAT: dict[str, Any] = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}]}
MakeGateway = Callable[..., Awaitable[Gw]]


async def scrape(gw: Gw, *, key: str | None = None) -> httpx.Response:
    runner = web.AppRunner(create_management_app(gw.gateway))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        async with httpx.AsyncClient() as c:
            headers = {"Authorization": f"Bearer {key or gw.key}"}
            return await c.get(f"http://{host}:{port}/metrics", headers=headers)
    finally:
        await runner.cleanup()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_count_outcomes_refusals_and_timings(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway({"deployments": [deployments(engine.url)]})
    engine.script = vllm_stream()
    async with gw.client() as c:
        for _ in range(3):
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await c.post("/v1/chat/completions", json={**CHAT, "n": 2})).status_code == 400
        assert (
            await c.post("/v1/chat/completions", json={**CHAT, "model": "x"})
        ).status_code == 404
        # One client hangs up mid-stream.
        engine.script = [event(chunk(delta={"role": "assistant", "content": ""})), Hold()]
        engine.arrived.clear()
        async with anyio.create_task_group() as tg:

            async def hang() -> None:
                await c.post("/v1/chat/completions", json={**CHAT, "stream": True})

            tg.start_soon(hang)
            with anyio.fail_after(5):
                await engine.arrived.wait()
            tg.cancel_scope.cancel()
        with anyio.fail_after(5):
            await engine.hung_up.wait()
    r = await scrape(gw)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    got = samples(r.text)

    def value(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    assert (
        value("capyctl_requests_total", deployment="my-model", api="chat", outcome="completed") == 3
    )
    assert (
        value("capyctl_requests_total", deployment="my-model", api="chat", outcome="refused") == 1
    )
    assert value("capyctl_requests_total", deployment="", api="chat", outcome="refused") == 1
    assert (
        value("capyctl_requests_total", deployment="my-model", api="chat", outcome="hang_up") == 1
    )
    assert value("capyctl_refusals_total", deployment="my-model", code="unsupported_parameter") == 1
    assert value("capyctl_refusals_total", deployment="", code="unknown_model") == 1
    for phase in ("queue_wait", "engine_first_byte", "first_content", "last_chunk", "total"):
        count = value(f"capyctl_{phase}_seconds_count", deployment="my-model", instance="0")
        assert count >= 3, phase
        assert value(f"capyctl_{phase}_seconds_bucket", deployment="my-model", instance="0",
                     le="+Inf") == count  # fmt: skip
    assert (
        value("capyctl_cut_requests", deployment="my-model", instance="0", settles="at_restart")
        == 1
    )
    assert value("capyctl_running", deployment="my-model") == 0
    assert value("capyctl_collector_state", deployment="my-model", instance="0", state="ready") == 1
    assert ("capyctl_sample_age_seconds", (("deployment", "my-model"), ("instance", "0"))) in got
    # A client's words never become a label: the unknown model counts under "".
    assert not any(dict(labels).get("deployment") == "x" for _, labels in got)


async def test_metrics_need_the_key(gateway: Gw) -> None:
    assert (await scrape(gateway, key="wrong")).status_code == 401


async def test_the_engines_prefix_cache_counts_are_shown_where_they_publish_them(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    """The engine's own counts come through as counters, per instance; an instance whose engine
    publishes none has no series (never a 0 nobody measured); status sums them per deployment."""
    from capyctl_gateway._management.status import deployment_status
    from tests.eventually import eventually

    silent = FakeEngine()
    app = web.Application()
    silent.routes(app)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    engine.prefix_cache = (4000.0, 3000.0)
    try:
        dep = deployments(engine.url)
        dep["instances"] = [{"url": engine.url}, {"url": f"http://{host}:{port}"}]
        gw = await make_gateway({"deployments": [dep]})
        fleet = gw.gateway.fleet

        def both_sampled() -> bool:
            return all(i.runner.sample() is not None for i in fleet.routes["my-model"].instances)

        await eventually(both_sampled)
        got = samples((await scrape(gw)).text)
        one = (("deployment", "my-model"), ("instance", "0"))
        other = (("deployment", "my-model"), ("instance", "1"))
        assert got[("capyctl_engine_prefix_cache_queried_tokens_total", one)] == 4000.0
        assert got[("capyctl_engine_prefix_cache_hit_tokens_total", one)] == 3000.0
        assert ("capyctl_engine_prefix_cache_queried_tokens_total", other) not in got
        assert ("capyctl_engine_prefix_cache_hit_tokens_total", other) not in got
        doc = deployment_status(fleet, "my-model")
        assert doc is not None
        assert doc["deployment"]["prefix_cache_hit_ratio"] == 0.75
        assert doc["deployment"]["routing"] == "prefix"
        rows = {i["index"]: i for i in doc["instances"]}
        assert rows[0]["prefix_cache"] == {"queried_tokens": 4000, "hit_tokens": 3000}
        assert "prefix_cache" not in rows[1]
    finally:
        await runner.cleanup()
