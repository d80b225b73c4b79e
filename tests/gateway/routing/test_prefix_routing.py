"""Prefix routing through the gateway, in one process and with two workers (whose authority
sees the fingerprints, never the body): a prompt goes where its prefix was sent, unless that
instance is busier than the margin allows; salts never share; an instance without a fresh
load sample is passed over only while another has one; ``least_load`` turns it off; an
instance whose cache went is forgotten."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from aiohttp import web

from canopyx_provider import ProviderOptions
from tests.eventually import eventually
from tests.gateway.conftest import FAKES, VIRTUAL_CLOCK, WORKERS, Gw, _serve, deployments
from tests.gateway.fake_engine import FakeEngine, vllm_stream
from tests.gateway.lifecycle.test_lifecycle import launched, management

workers = WORKERS
fakes = FAKES  # launched engines run on the fake runner; url: engines are watched alike
anyio_backend = VIRTUAL_CLOCK  # every engine and client runs in this process
pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]
SYSTEM = {name: f"You are the {name} desk. " * 120 for name in ("billing", "shipping", "legal")}


@pytest.fixture
async def pair() -> AsyncIterator[list[FakeEngine]]:
    fakes, runners = [], []
    for _ in range(2):
        fake = FakeEngine(script=vllm_stream())
        app = web.Application()
        fake.routes(app)
        runner, fake.url = await _serve(app)
        fakes.append(fake)
        runners.append(runner)
    try:
        yield fakes
    finally:
        for runner in runners:
            await runner.cleanup()


def config(engines: list[FakeEngine], **over: Any) -> dict[str, Any]:
    dep = deployments(engines[0].url, **over)
    dep["instances"] = [{"url": e.url} for e in engines]
    return {"deployments": [dep]}


def chat(tenant: str, turn: str, **more: Any) -> dict[str, Any]:
    msgs = [{"role": "system", "content": SYSTEM[tenant]}, {"role": "user", "content": turn}]
    return {"model": "my-model", "messages": msgs, **more}


def selections(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        getattr(r, "fields", {})
        for r in caplog.records
        if getattr(r, "event", None) == "router_selection"
    ]


async def both_sampled(gw: Gw, engines: list[FakeEngine]) -> None:
    """Wait until the collector holds a fresh sample of each engine with its reported load."""
    route = gw.gateway.fleet.routes["my-model"]

    def sampled() -> bool:
        samples = [i.runner.sample() for i in route.instances]
        return all(
            s is not None and s.running == e.running for s, e in zip(samples, engines, strict=True)
        )

    await eventually(sampled)


async def sampled_gateway(
    make_gateway: MakeGateway,
    pair: list[FakeEngine],
    caplog: pytest.LogCaptureFixture,
    **over: Any,
) -> Gw:
    """A gateway over ``pair`` (``over``: more of the deployment) once both engines are sampled,
    its router lines captured from then on."""
    gw = await make_gateway(config(pair, **over))
    await both_sampled(gw, pair)
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    return gw


async def test_a_tenants_prompts_go_where_its_prefix_was_sent(
    pair: list[FakeEngine], make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await sampled_gateway(make_gateway, pair, caplog)
    async with gw.client() as c:
        for turn in range(4):
            for tenant in SYSTEM:
                r = await c.post("/v1/chat/completions", json=chat(tenant, f"question {turn}"))
                assert r.status_code == 200, r.text
    picks = selections(caplog)
    assert len(picks) == 12
    by_tenant: dict[str, set[int]] = {}
    for n, pick in enumerate(picks):
        by_tenant.setdefault(list(SYSTEM)[n % 3], set()).add(pick["instance"])
        assert pick["prefix_blocks"] > 10
        if n >= 3:  # every tenant's first prompt was sent somewhere already
            assert pick["why"] == "prefix", pick
            chosen = next(c for c in pick["candidates"] if c["instance"] == pick["instance"])
            assert chosen["matched_blocks"] >= 10
    assert all(len(sent) == 1 for sent in by_tenant.values()), by_tenant
    assert sum(len(e.received) for e in pair) == 12
    lines = [
        r.getMessage() for r in caplog.records if getattr(r, "event", None) == "router_selection"
    ]
    last = picks[-1]
    mine = next(c for c in last["candidates"] if c["instance"] == last["instance"])
    assert lines[-1].endswith(
        f"instance {last['instance']} (prefix: {mine['matched_blocks']} of "
        f"{last['prefix_blocks']} blocks, load {mine['score']})"
    ), lines[-1]


async def test_a_holder_busier_than_the_margin_loses_the_request_to_the_least_loaded(
    pair: list[FakeEngine], make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await sampled_gateway(make_gateway, pair, caplog, routing={"load_margin": 3})
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat("billing", "a"))).status_code == 200
        holder = selections(caplog)[-1]["instance"]
        pair[holder].running = 3  # within the margin: it keeps the prefix's requests
        await both_sampled(gw, pair)
        assert (await c.post("/v1/chat/completions", json=chat("billing", "b"))).status_code == 200
        kept = selections(caplog)[-1]
        pair[holder].running = 4  # past it: the least loaded takes the request
        await both_sampled(gw, pair)
        assert (await c.post("/v1/chat/completions", json=chat("billing", "c"))).status_code == 200
        moved = selections(caplog)[-1]
    assert (kept["instance"], kept["why"]) == (holder, "prefix")
    assert (moved["instance"], moved["why"]) == (1 - holder, "load_margin")
    scores = {c["instance"]: c["score"] for c in moved["candidates"]}
    assert scores == {holder: 4, 1 - holder: 0}


async def test_a_new_prefix_goes_to_the_cache_that_holds_the_fewest(
    pair: list[FakeEngine], make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """Tenant A's two prompts (the second a hit) then tenant B's first: the turn would start B
    at A's instance (both idle), but B goes to the cache that holds nothing yet."""
    gw = await sampled_gateway(make_gateway, pair, caplog)
    async with gw.client() as c:
        for tenant, turn in (("billing", "a"), ("billing", "b"), ("shipping", "a")):
            r = await c.post("/v1/chat/completions", json=chat(tenant, turn))
            assert r.status_code == 200
    a1, a2, b1 = selections(caplog)
    assert a1["why"] == "least_cached" and a2["why"] == "prefix"
    assert a2["instance"] == a1["instance"]
    assert (b1["why"], b1["instance"]) == ("least_cached", 1 - a1["instance"])
    route = gw.gateway.fleet.routes["my-model"]
    assert route.prefixes is not None
    held = [route.prefixes.held(i.index) for i in route.instances]
    assert all(n >= 10 for n in held), held


async def test_a_full_cache_alone_does_not_move_a_prefix_off_its_engine(
    pair: list[FakeEngine], make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """The margin counts requests: a holder with two running and its KV cache full (load 2 + 8
    for the cache) keeps its prefix against an idle engine under the default margin of 4; the
    least loaded choice for a new prompt still weighs the full cache."""
    gw = await sampled_gateway(make_gateway, pair, caplog)
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat("legal", "a"))).status_code == 200
        holder = selections(caplog)[-1]["instance"]
        pair[holder].running, pair[holder].kv_usage = 2, 1.0
        await both_sampled(gw, pair)
        assert (await c.post("/v1/chat/completions", json=chat("legal", "b"))).status_code == 200
    kept = selections(caplog)[-1]
    assert (kept["instance"], kept["why"]) == (holder, "prefix")
    scores = {row["instance"]: row["score"] for row in kept["candidates"]}
    assert scores == {holder: 10, 1 - holder: 0}


async def test_one_salts_prefix_never_draws_anothers_request(
    pair: list[FakeEngine], make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await sampled_gateway(make_gateway, pair, caplog)
    async with gw.client() as c:
        for salt in ("tenant-a", "tenant-b", "tenant-a"):
            body = chat("legal", "same words", cache_salt=salt)
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
    first, other, again = selections(caplog)
    assert (other["why"], other["instance"]) == ("least_cached", 1 - first["instance"])
    assert all(c["matched_blocks"] == 0 for c in other["candidates"])
    assert (again["why"], again["instance"]) == ("prefix", first["instance"])


QUICK_STALE = ProviderOptions(
    poll_interval_ms=50, request_timeout_ms=2000, connect_attempts=1, max_metrics_age_ms=400
)
"""The tests' collector, with samples old after 0.4 s: an engine goes quiet quickly."""


def plain(text: str) -> dict[str, Any]:
    return {"model": "my-model", "messages": [{"role": "user", "content": text}]}


async def test_an_instance_whose_samples_went_quiet_is_passed_over_only_while_one_has_one(
    pair: list[FakeEngine], make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await make_gateway(config(pair), collector=QUICK_STALE)
    await both_sampled(gw, pair)
    route = gw.gateway.fleet.routes["my-model"]
    pair[0].metrics_served = False  # sampled since it started, then quiet
    await eventually(lambda: route.instances[0].runner.stale())
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    async with gw.client() as c:
        for turn in range(4):  # a prefix sent to neither: the fresh one takes every one
            assert (await c.post("/v1/chat/completions", json=plain(f"t{turn}"))).status_code == 200
        pair[1].metrics_served = False  # now neither has a fresh sample: neither is blocked
        await eventually(lambda: route.instances[1].runner.stale())
        for turn in range(4):
            assert (await c.post("/v1/chat/completions", json=plain(f"u{turn}"))).status_code == 200
    picks = selections(caplog)
    assert [p["instance"] for p in picks[:4]] == [1, 1, 1, 1]
    for p in picks[:4]:
        assert [(s["instance"], s["reason"]) for s in p["skipped"]] == [(0, "stale_sample")]
    assert {p["instance"] for p in picks[4:]} == {0, 1}  # the turn rotates over both
    assert all(p["skipped"] == [] for p in picks[4:])
    assert len(pair[0].received) == 2 and len(pair[1].received) == 6


async def test_an_engine_not_sampled_yet_is_not_passed_over(
    pair: list[FakeEngine], make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine whose first look by the collector is still under way has no sample yet: it is
    not suspect, so requests do not all pile onto the one already sampled (the several-machines
    test saw four streams sent to one host that way). Once the look has failed, it is."""
    pair[0].health_hold = asyncio.Event()
    slow = ProviderOptions(poll_interval_ms=50, request_timeout_ms=30_000, connect_attempts=1)
    gw = await make_gateway(config(pair), collector=slow)
    route = gw.gateway.fleet.routes["my-model"]
    await eventually(lambda: route.instances[1].runner.sample() is not None)
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    async with gw.client() as c:
        for turn in range(4):
            assert (await c.post("/v1/chat/completions", json=plain(f"t{turn}"))).status_code == 200
    picks = selections(caplog)
    assert {p["instance"] for p in picks} == {0, 1}
    assert all(p["skipped"] == [] for p in picks)
    assert not route.instances[0].runner.stale()
    pair[0].healthy = False  # its first look ends, failed: now it is suspect
    pair[0].health_hold.set()
    await eventually(lambda: route.instances[0].runner.stale())


async def test_least_load_routing_weighs_no_prefix(
    pair: list[FakeEngine], make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await sampled_gateway(make_gateway, pair, caplog, routing={"policy": "least_load"})
    async with gw.client() as c:
        for turn in range(4):
            r = await c.post("/v1/chat/completions", json=chat("billing", f"q{turn}"))
            assert r.status_code == 200
    picks = selections(caplog)
    assert [p["instance"] for p in picks] in ([0, 1, 0, 1], [1, 0, 1, 0])  # the turn, alone
    assert all(p["why"] == "least_load" and "prefix_blocks" not in p for p in picks)
    assert gw.gateway.fleet.routes["my-model"].prefixes is None


async def test_an_instance_whose_cache_went_is_forgotten(
    make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """Two launched instances (on the fake runner): what each was sent is forgotten when an
    operator parks the deployment (a park here is a stop), so no request is drawn to a cache
    that is gone."""
    dep = launched()
    dep["instances"] = dep["instances"] * 2
    gw = await make_gateway({"deployments": [dep]})
    route = gw.gateway.fleet.routes["my-model"]
    assert route.prefixes is not None
    runner, base = await management(gw)
    auth = {"Authorization": f"Bearer {gw.key}"}
    try:
        async with gw.client() as c, httpx.AsyncClient(headers=auth, timeout=60) as m:
            for tenant in SYSTEM:
                r = await c.post("/v1/chat/completions", json=chat(tenant, "hello"))
                assert r.status_code == 200
            held = [route.prefixes.held(i.index) for i in route.instances]
            assert sum(held) >= 30
            parked = await m.post(f"{base}/deployments/my-model/park")
            assert parked.json()["deployment"]["lifecycle"] == "stopped"
            assert len(route.prefixes) == 0
            caplog.set_level(logging.INFO, logger="capyctl_gateway")
            r = await c.post("/v1/chat/completions", json=chat("billing", "again"))
            assert r.status_code == 200
    finally:
        await runner.cleanup()
    (pick,) = selections(caplog)
    assert pick["why"] == "least_cached" and pick["candidates"][0]["matched_blocks"] == 0
