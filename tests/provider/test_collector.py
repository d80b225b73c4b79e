"""The collector against engines served over real loopback sockets."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import anyio
import httpx
import pytest
from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

from canopyx_provider import (
    Collector,
    EngineRestarted,
    EngineUnreachableError,
    Event,
    ProviderOptions,
    ScrapeError,
    ScrapeFailed,
    ScrapeSucceeded,
    ScrapeTimeoutError,
    TargetState,
    llama_cpp,
    mlx,
    ollama,
    sglang,
    tabby_api,
    tensorfold,
    vllm,
)
from canopyx_provider._scrape import HttpxFetcher, map_httpx_errors
from tests.conftest import recorded, requests_to, serve
from tests.provider.fakes import (
    DroppingServer,
    llamacpp_10798,
    sglang_0521,
    subclasses_of,
    vllm_031,
)

pytestmark = pytest.mark.anyio
FAST = ProviderOptions(poll_interval_ms=20, request_timeout_ms=1000, connect_attempts=1)


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_vllm_startup_checks_pass_and_give_a_snapshot(engine: HTTPServer) -> None:
    vllm_031(engine)
    async with Collector(options=FAST) as c:
        c.add("e", vllm(engine.url_for("/ignored/path")), model_id="tiny", poll=False)
        report = await c.check("e")
        assert [(r.name, r.ok) for r in report.checks] == [
            ("health", True),
            ("models", True),
            ("discovery", True),
            ("metrics", True),
        ]
        assert report.engine_version == "0.31.0"
        assert report.capacity is not None and report.capacity.kv_cache_tokens == 1048576
        snap = c.snapshot("e")
        assert snap is not None and snap.engine_version == "0.31.0"
        assert snap.metrics.running_requests == 0
        assert snap.requested_at <= snap.collected_at
    assert report.to_dict()["checks"][0] == {"name": "health", "ok": True, "reason": None}
    assert json.loads(report.to_json()) == report.to_dict()


async def test_api_key_is_sent_on_every_collection_request(engine: HTTPServer) -> None:
    vllm_031(engine)
    async with Collector(options=FAST) as c:
        c.add("e", vllm(engine.url_for("/"), api_key="sk-engine"), model_id="tiny", poll=False)
        assert (await c.check("e")).ok
        await c.refresh("e")
    assert len(engine.log) >= 6
    assert {req.headers.get("Authorization") for req, _ in engine.log} == {"Bearer sk-engine"}


async def test_metrics_url_overrides_the_scrape_url(engine: HTTPServer) -> None:
    vllm_031(engine)
    serve(engine, "/custom/scrape", "vllm/0.32.0/GET_metrics_busy_2_running.http")
    adapter = vllm(engine.url_for("/"), metrics_url=engine.url_for("/custom/scrape"))
    async with Collector(options=FAST) as c:
        c.add("e", adapter, model_id="tiny", poll=False)
        assert (await c.check("e")).ok
        snap = c.snapshot("e")
    assert snap is not None and snap.metrics.running_requests == 2
    assert requests_to(engine, "/metrics") == []


async def test_unreachable_engine_fails_the_health_check() -> None:
    async with Collector(options=FAST) as c:
        c.add("e", vllm("http://127.0.0.1:9"), model_id="tiny", poll=False)  # discard port
        report = await c.check("e")
        status = c.status("e")
    assert report.failed is not None and report.failed.name == "health"
    assert report.failed.code == "unreachable"
    assert [r.reason for r in report.checks[1:]] == ["not run: the health check failed"] * 3
    assert status.state is TargetState.FAILED and status.latest is None


async def test_unhealthy_engine(engine: HTTPServer) -> None:
    serve(engine, "/health", "sglang/0.5.21/GET_health_starting.http")
    async with Collector(options=FAST) as c:
        c.add("e", sglang(engine.url_for("/")), model_id="Qwen/Qwen3-8B", poll=False)
        report = await c.check("e")
    assert report.failed is not None and report.failed.name == "health"
    assert "503" in (report.failed.reason or "")


async def test_model_not_listed_fails_the_models_check(engine: HTTPServer) -> None:
    vllm_031(engine)
    async with Collector(options=FAST) as c:
        c.add("e", vllm(engine.url_for("/")), model_id="Qwen3-4B", poll=False)
        report = await c.check("e")
    assert report.failed is not None and report.failed.name == "models"
    assert report.failed.reason == "the engine lists 'tiny', not 'Qwen3-4B'"
    assert requests_to(engine, "/metrics") == []


async def test_metrics_of_another_engine_fail_validation(engine: HTTPServer) -> None:
    vllm_031(engine, metrics="vllm/0.17.1/GET_metrics.http")  # exposes Qwen/Qwen3-8B only
    async with Collector(options=FAST) as c:
        c.add("e", vllm(engine.url_for("/")), model_id="tiny", poll=False)
        report = await c.check("e")
        assert c.snapshot("e") is None
    # discovery reads cache_config_info, which has no model_name: it passes; metrics do not
    assert report.failed is not None and report.failed.name == "metrics"
    assert report.failed.code == "missing_metric"
    assert "vllm:num_requests_running" in (report.failed.reason or "")


async def test_a_slow_engine_times_out_within_the_request_timeout(
    threaded_engine: HTTPServer,
) -> None:
    engine = threaded_engine

    release, second = threading.Event(), threading.Event()
    arrived: list[Request] = []

    def stall(request: Request) -> Response:
        arrived.append(request)
        if len(arrived) == 2:
            second.set()
        release.wait(5)
        return Response("")

    engine.expect_request("/health").respond_with_handler(stall)
    options = ProviderOptions(request_timeout_ms=400, connect_attempts=2)
    try:
        async with Collector(options=options) as c:
            c.add("e", vllm(engine.url_for("/")), model_id="tiny", poll=False)
            report = await c.check("e")
        # The retry was sent before check() gave up; the server thread may still be taking it.
        assert await anyio.to_thread.run_sync(second.wait, 5)
    finally:
        release.set()
    assert report.failed is not None and report.failed.code == "timeout"
    assert len(arrived) == 2  # retried once, bounded by connect_attempts


async def test_freshness_with_an_injected_clock(engine: HTTPServer) -> None:
    vllm_031(engine)
    clock = Clock()
    options = ProviderOptions(max_metrics_age_ms=5000, connect_attempts=1)
    async with Collector(options=options, clock=clock) as c:
        c.add("e", vllm(engine.url_for("/")), model_id="tiny", poll=False)
        await c.refresh("e")
        snap = c.snapshot("e")
        assert snap is not None and snap.collected_at == clock.now
        clock.now += 5.0
        assert c.snapshot("e") is snap  # exactly max age: still usable
        clock.now += 0.001
        assert c.snapshot("e") is None
        assert c.status("e").latest is snap and not c.status("e").fresh
        await c.refresh("e")
        assert c.snapshot("e") is not None


async def test_a_failed_poll_invalidates_at_once_and_the_next_one_reconnects(
    engine: HTTPServer,
) -> None:
    vllm_031(engine)
    clock = Clock()
    events: list[Event] = []
    async with Collector(options=FAST, clock=clock, hooks=[events.append]) as c:
        c.add("e", vllm(engine.url_for("/")), model_id="tiny", poll=False)
        await c.refresh("e")
        assert c.snapshot("e") is not None
        engine.clear()
        engine.expect_request("/health").respond_with_data("")
        engine.expect_request("/metrics").respond_with_data("oops", status=500)
        assert await c.refresh("e") is None  # no time passed: invalid, not stale
        status = c.status("e")
        assert status.state is TargetState.FAILED
        assert status.error is not None and status.error.startswith("metrics:")
        assert [ch.ok for ch in status.checks] == [True, True, True, False]
        engine.clear()
        vllm_031(engine)
        assert await c.refresh("e") is not None
    failed = [e for e in events if isinstance(e, ScrapeFailed)]
    assert len(failed) == 1 and failed[0].check == "metrics"
    assert len(requests_to(engine, "/v1/models")) == 1  # the recovery went through the checks


async def test_a_new_process_start_is_a_restart_and_rediscovers(engine: HTTPServer) -> None:
    vllm_031(engine, metrics="vllm/0.32.0/GET_metrics_idle.http")
    events: list[Event] = []
    async with Collector(options=FAST, hooks=[events.append]) as c:
        c.add("e", vllm(engine.url_for("/")), model_id="tiny", poll=False)
        await c.refresh("e")
        engine.clear()
        text = recorded("vllm/0.32.0/GET_metrics_idle.http").text
        restarted = text.replace("1.79604298065e+09", "1.79604399e+09")
        vllm_031(engine, metrics="vllm/0.32.0/GET_metrics_idle.http")
        engine.clear()
        engine.expect_request("/health").respond_with_data("")
        engine.expect_request("/metrics").respond_with_data(restarted)
        await c.refresh("e")
        assert c.snapshot("e") is not None  # the sample itself is good
        assert c.status("e").state is TargetState.READY
    restarts = [e for e in events if isinstance(e, EngineRestarted)]
    assert len(restarts) == 1 and restarts[0].current == pytest.approx(1.79604399e9)


async def test_llamacpp_reads_slots_and_build_from_props(engine: HTTPServer) -> None:
    llamacpp_10798(engine)
    async with Collector(options=FAST) as c:
        c.add("e", llama_cpp(engine.url_for("/")), model_id="tiny", poll=False)
        report = await c.check("e")
        snap = c.snapshot("e")
    assert report.ok and report.engine_version == "b10798"
    assert snap is not None and snap.metrics.slot_usage_ratio == 1.0
    assert snap.process_start == 2145325713.0  # the Process-Start-Time-Unix header


async def test_llamacpp_slots_option_when_props_is_unavailable(engine: HTTPServer) -> None:
    llamacpp_10798(engine, props=False)
    engine.expect_request("/props").respond_with_data("not found", status=404)
    async with Collector(options=FAST) as c:
        c.add("with", llama_cpp(engine.url_for("/"), slots=4), model_id="tiny", poll=False)
        c.add("without", llama_cpp(engine.url_for("/")), model_id="tiny", poll=False)
        ok, bad = await c.check("with"), await c.check("without")
        snap = c.snapshot("with")
    assert ok.ok and ok.capacity is not None and ok.capacity.total_slots == 4
    assert snap is not None and snap.metrics.slot_usage_ratio == 0.5
    assert bad.failed is not None and bad.failed.name == "discovery"
    assert "slots=" in (bad.failed.reason or "")


async def test_llamacpp_router_never_makes_the_engine_load_a_model(engine: HTTPServer) -> None:
    serve(engine, "/health", "llamacpp/b10798/router/GET_health.http")
    serve(engine, "/v1/models", "llamacpp/b10798/router/GET_v1_models_after_a.http")
    q = {"model": "tiny-a", "autoload": "false"}
    serve(engine, "/props", "llamacpp/b10798/router/GET_props_model_a.http", query_string=q)
    serve(engine, "/metrics", "llamacpp/b10798/router/GET_metrics_model_a.http", query_string=q)
    q_b = {"model": "tiny-b", "autoload": "false"}
    serve(
        engine,
        "/props",
        "llamacpp/b10798/router/GET_props_model_a_autoload_false_unloaded.http",
        query_string=q_b,
    )
    async with Collector(options=FAST) as c:
        c.add("a", llama_cpp(engine.url_for("/"), router=True), model_id="tiny-a", poll=False)
        c.add("b", llama_cpp(engine.url_for("/"), router=True), model_id="tiny-b", poll=False)
        a, b = await c.check("a"), await c.check("b")
    assert a.ok and a.capacity is not None and a.capacity.total_slots == 2
    assert b.failed is not None and b.failed.name == "discovery"
    assert "model is not loaded" in (b.failed.reason or "")
    scoped = [req for req, _ in engine.log if req.path in ("/props", "/metrics")]
    assert scoped and all(req.args.get("autoload") == "false" for req in scoped)


async def test_sglang_falls_back_to_get_server_info(engine: HTTPServer) -> None:
    sglang_0521(engine)
    engine.clear()
    serve(engine, "/health", "sglang/0.5.21/GET_health.http")
    serve(engine, "/v1/models", "sglang/0.5.21/GET_v1_models.http")
    serve(engine, "/metrics", "sglang/0.5.21/GET_metrics.http")
    engine.expect_request("/server_info").respond_with_data("", status=404)
    serve(engine, "/get_server_info", "sglang/0.5.21/GET_server_info.http")
    async with Collector(options=FAST) as c:
        c.add("e", sglang(engine.url_for("/")), model_id="Qwen/Qwen3-8B", poll=False)
        report = await c.check("e")
    assert report.ok and report.engine_version == "0.5.21"
    assert report.capacity is not None and report.capacity.max_running_requests == 4096


@pytest.mark.parametrize(
    ("factory", "health", "models", "model"),
    [
        (
            ollama,
            ("/api/version", "ollama/0.33.1/GET_api_version.http"),
            "ollama/0.33.1/GET_v1_models.http",
            "llama3.2:3b",
        ),
        (
            mlx,
            ("/health", "mlx/0.32.2/GET_health.http"),
            "mlx/0.32.2/GET_v1_models.http",
            "/models/local-qwen",
        ),
        (
            tabby_api,
            ("/health", "tabbyapi/unpinned/GET_health.http"),
            "tabbyapi/unpinned/GET_v1_models.http",
            "Qwen3-8B-exl3",
        ),
    ],
)
async def test_health_only_engines_give_fresh_snapshots_without_load(
    engine: HTTPServer, factory: object, health: tuple[str, str], models: str, model: str
) -> None:
    serve(engine, *health)
    serve(engine, "/v1/models", models)
    async with Collector(options=FAST) as c:
        c.add("e", factory(engine.url_for("/")), model_id=model, poll=False)  # type: ignore[operator]
        report = await c.check("e")
        snap = c.snapshot("e")
    assert [r.name for r in report.checks] == ["health", "models", "discovery"]
    assert report.ok
    assert snap is not None and snap.metrics.has_engine_load is False
    assert snap.metrics.figures() == {}
    assert requests_to(engine, "/metrics") == []


async def test_unhealthy_mlx_is_a_health_failure(engine: HTTPServer) -> None:
    serve(engine, "/health", "mlx/0.32.2/GET_health_unavailable.http")
    async with Collector(options=FAST) as c:
        c.add("e", mlx(engine.url_for("/")), model_id="x", poll=False)
        report = await c.check("e")
    assert report.failed is not None and report.failed.name == "health"


async def test_tensorfold_load_from_health(engine: HTTPServer) -> None:
    serve(engine, "/health", "tensorfold/0.6.1/GET_health.http")
    serve(engine, "/v1/models", "tensorfold/0.6.1/GET_v1_models.http")
    async with Collector(options=FAST) as c:
        c.add("e", tensorfold(engine.url_for("/")), model_id="clef-flash", poll=False)
        report = await c.check("e")
        snap = c.snapshot("e")
    assert report.ok and snap is not None
    assert (snap.metrics.running_requests, snap.metrics.busy) == (2, True)
    assert requests_to(engine, "/metrics") == []


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_the_collector_polls_on_its_own_schedule(engine: HTTPServer) -> None:
    vllm_031(engine)
    seen: list[ScrapeSucceeded] = []
    enough = anyio.Event()

    def hook(event: Event) -> None:
        if isinstance(event, ScrapeSucceeded):
            seen.append(event)
            if len(seen) == 3:
                enough.set()

    async with Collector(options=FAST, hooks=[hook]) as c:
        c.add("e", vllm(engine.url_for("/")), model_id="tiny")
        with anyio.fail_after(10):
            await enough.wait()
        assert c.snapshot("e") is not None
    times = [e.snapshot.requested_at for e in seen]
    assert times == sorted(times) and len(set(times)) == 3
    assert len(requests_to(engine, "/v1/models")) == 1  # checked once, then polled


async def test_set_poll_interval_takes_effect_at_once(engine: HTTPServer) -> None:
    vllm_031(engine)
    count = 0
    second = anyio.Event()

    def hook(event: Event) -> None:
        nonlocal count
        if isinstance(event, ScrapeSucceeded):
            count += 1
            if count == 2:
                second.set()

    slow = ProviderOptions(poll_interval_ms=60_000, connect_attempts=1)
    async with Collector(options=slow, hooks=[hook]) as c:
        c.add("e", vllm(engine.url_for("/")), model_id="tiny")
        c.set_poll_interval("e", 250)
        with anyio.fail_after(10):
            await second.wait()  # would take a minute at the default interval
        assert c.status("e").poll_interval_s == 0.25


def test_every_httpx_transport_error_is_mapped() -> None:
    classes = subclasses_of(httpx.TransportError)
    assert len(classes) > 10
    for cls in classes:
        with pytest.raises(ScrapeError) as info, map_httpx_errors("http://e"):
            raise cls("boom")
        assert info.value.url == "http://e"
        if issubclass(cls, httpx.TimeoutException):
            assert isinstance(info.value, ScrapeTimeoutError)
        if issubclass(cls, httpx.ConnectError):
            assert isinstance(info.value, EngineUnreachableError)


@pytest.fixture
def dropping() -> Iterator[DroppingServer]:
    server = DroppingServer()
    yield server
    server.close()


async def test_a_kept_alive_connection_closed_under_a_get_is_retried_once_on_a_new_one(
    dropping: DroppingServer,
) -> None:
    url = f"http://127.0.0.1:{dropping.port}/health"
    async with httpx.AsyncClient(timeout=5) as client:
        fetcher = HttpxFetcher(client)
        assert (await fetcher.get(url, headers={})).status == 200
        second = await fetcher.get(url, headers={})  # meets the closed connection first
    assert second.status == 200
    assert (dropping.connections, dropping.answered) == (2, 2)


async def test_an_engine_that_always_drops_the_connection_is_a_broken_answer() -> None:
    server = DroppingServer(always=True)
    url = f"http://127.0.0.1:{server.port}/health"
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            with pytest.raises(ScrapeError, match="broken answer") as info:
                await HttpxFetcher(client).get(url, headers={})
    finally:
        server.close()
    assert not isinstance(info.value, (EngineUnreachableError, ScrapeTimeoutError))
    assert server.connections == 2  # one retry, not more
