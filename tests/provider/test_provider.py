"""The connector end to end: an in-process Canopy, a real socket engine, a strategy."""

from __future__ import annotations

import dataclasses
import logging
import time
from decimal import Decimal

import anyio
import anyio.lowlevel
import pytest
from pytest_httpserver import HTTPServer

from canopyx_provider import (
    CanopyCounts,
    Decline,
    Event,
    InProcessLink,
    LoadAndAdmission,
    Price,
    PricePublication,
    PricingStrategy,
    Provider,
    ProviderOptions,
    QuoteAnswer,
    QuoteContext,
    QuoteRequest,
    ScrapeSucceeded,
    StatusReport,
    vllm,
)
from tests.conftest import recorded
from tests.eventually import eventually

pytestmark = pytest.mark.anyio
LIST = Price(Decimal("0.20"), Decimal("0.60"))
OPTIONS = ProviderOptions(poll_interval_ms=20, connect_attempts=1)

# Figures no message to Canopy may ever carry.
DISTINCT = {
    "running": "7",
    "waiting": "0",
    "kv": "0.4242",
    "prompt": "918273",
    "generated": "564738",
}


def distinctive_metrics() -> str:
    text = recorded("vllm/0.31.0/GET_metrics_idle.http").text
    for name, value in (
        ("vllm:num_requests_running", DISTINCT["running"]),
        ("vllm:kv_cache_usage_perc", DISTINCT["kv"]),
        ("vllm:prompt_tokens_total", DISTINCT["prompt"]),
        ("vllm:generation_tokens_total", DISTINCT["generated"]),
    ):
        prefix = name + '{engine="0",model_name="tiny"} '
        start = text.index(prefix) + len(prefix)
        end = text.index("\n", start)
        text = text[:start] + value + text[end:]
    return text


def serve_engine(engine: HTTPServer, metrics: str) -> None:
    engine.expect_request("/health").respond_with_data("")
    engine.expect_request("/version").respond_with_data('{"version":"0.31.0"}')
    engine.expect_request("/v1/models").respond_with_response(
        recorded("vllm/0.31.0/GET_v1_models.http").response()
    )
    engine.expect_request("/metrics").respond_with_data(metrics)


async def test_connect_report_publish_and_quote_without_metrics_crossing_the_link(
    engine: HTTPServer,
) -> None:
    serve_engine(engine, distinctive_metrics())
    link = InProcessLink("tiny", counts=CanopyCounts(active_requests=1))
    queued = anyio.Event()

    def hook(event: Event) -> None:
        if isinstance(event, ScrapeSucceeded) and event.snapshot.metrics.waiting_requests == 3:
            queued.set()

    provider = Provider(
        vllm(engine.url_for("/")), LoadAndAdmission(LIST), link, options=OPTIONS, hooks=[hook]
    )
    with link:
        async with anyio.create_task_group() as tg:
            tg.start_soon(provider.run)
            with anyio.fail_after(10):
                await link.ready.wait()
                # 7 running, 0 waiting, KV 0.4242: admitted, above the list price
                priced = await link.request_quote(QuoteRequest("q1", "tiny", 100, 10))
            engine.clear()
            serve_engine(
                engine,
                distinctive_metrics().replace('model_name="tiny"} 0.0', 'model_name="tiny"} 3.0'),
            )
            with anyio.fail_after(10):
                await queued.wait()  # the collector has seen the engine's queue
                declined = await link.request_quote(QuoteRequest("q2", "tiny", 1, 1))
            tg.cancel_scope.cancel()

    assert priced.price is not None and priced.price.input_per_mtok > LIST.input_per_mtok
    kinds = [type(m) for m in link.sent]
    assert kinds[:2] == [StatusReport, PricePublication]
    report = link.sent[0]
    assert isinstance(report, StatusReport) and report.ready
    assert [c.name for c in report.checks] == ["health", "models", "discovery", "metrics"]
    assert declined.price is None and declined.decline_code == "engine_queue"
    assert [m for m in link.sent if isinstance(m, QuoteAnswer)] == [priced, declined]

    # Metrics stay on the provider's machine: no message type has a field for them, and no
    # message, however rendered, contains a collected figure.
    for message in link.sent:
        fields = {f.name for f in dataclasses.fields(message)}
        assert not fields & {"metrics", "snapshot", "running_requests", "kv_cache_usage_ratio"}
        rendered = repr(message) + str(dataclasses.asdict(message))
        for value in ("0.4242", DISTINCT["prompt"], DISTINCT["generated"], "running"):
            assert value not in rendered


async def test_a_check_that_fails_while_serving_is_reported_and_so_is_its_recovery(
    engine: HTTPServer,
) -> None:
    """Canopy heard of the checks at startup only: a metrics check failing later was logged
    here and never reported. Now each change is, and only changes."""
    good = recorded("vllm/0.31.0/GET_metrics_idle.http").text
    serve_engine(engine, good)
    link = InProcessLink("tiny")
    provider = Provider(vllm(engine.url_for("/")), LoadAndAdmission(LIST), link, options=OPTIONS)

    def reports() -> list[StatusReport]:
        return [m for m in link.sent if isinstance(m, StatusReport)]

    with link:
        async with anyio.create_task_group() as tg:
            tg.start_soon(provider.run)
            with anyio.fail_after(10):
                await link.ready.wait()
            engine.clear()
            serve_engine(engine, recorded("vllm/0.17.1/GET_metrics.http").text)  # another model
            await eventually(lambda: len(reports()) >= 2)
            engine.clear()
            serve_engine(engine, good)
            await eventually(lambda: len(reports()) >= 3 and reports()[-1].ready)
            tg.cancel_scope.cancel()
    sent = reports()
    assert sent[0].ready and not sent[1].ready and sent[-1].ready
    failed = [c for c in sent[1].checks if not c.ok]
    assert [(c.name, c.code) for c in failed] == [("metrics", "missing_metric")]
    assert all(a != b for a, b in zip(sent, sent[1:], strict=False))  # changes only


async def test_failed_startup_reports_but_publishes_no_price(engine: HTTPServer) -> None:
    serve_engine(engine, recorded("vllm/0.17.1/GET_metrics.http").text)  # another model's metrics
    link = InProcessLink("tiny")
    provider = Provider(vllm(engine.url_for("/")), LoadAndAdmission(LIST), link, options=OPTIONS)
    with link:
        async with anyio.create_task_group() as tg:
            tg.start_soon(provider.run)
            with anyio.fail_after(10):
                await link.reported.wait()
            tg.cancel_scope.cancel()
    report = link.sent[0]
    assert isinstance(report, StatusReport) and not report.ready
    failed = [c for c in report.checks if not c.ok]
    assert failed[0].name == "metrics" and failed[0].code == "missing_metric"
    assert not any(isinstance(m, PricePublication) for m in link.sent)
    error = provider.overview().error
    assert error is not None and "vllm:num_requests_running" in error


# -- quote callbacks are bounded by request_timeout_ms --------------------------------------
QUICK = ProviderOptions(poll_interval_ms=20, request_timeout_ms=50, connect_attempts=1)


class Stalling:
    """An async callback that never answers request ``stall``, and answers others at once."""

    list_price = LIST

    def __init__(self) -> None:
        self.never = anyio.Event()  # never set
        self.cancelled = anyio.Event()
        self.finished: list[str] = []

    async def quote(self, request: QuoteRequest, context: QuoteContext) -> Price | Decline:
        if request.request_id == "stall":
            try:
                await self.never.wait()
            except anyio.get_cancelled_exc_class():
                self.cancelled.set()
                raise
        await anyio.lowlevel.checkpoint()
        self.finished.append(request.request_id)
        return LIST


class Overrunning:
    """A plain callback that cannot be interrupted: it runs past the timeout, then answers."""

    list_price = LIST

    def quote(self, request: QuoteRequest, context: QuoteContext) -> Price | Decline:
        if request.request_id == "stall":
            time.sleep(QUICK.request_timeout_s + 0.03)  # past the timeout, the one thing tested
        return LIST


async def ask(
    engine: HTTPServer, strategy: PricingStrategy, *requests: QuoteRequest
) -> list[QuoteAnswer]:
    serve_engine(engine, recorded("vllm/0.31.0/GET_metrics_idle.http").text)
    link = InProcessLink("tiny")
    adapter = vllm(engine.url_for("/"), api_key="k-engine-secret")
    provider = Provider(adapter, strategy, link, options=QUICK)
    with link:
        async with anyio.create_task_group() as tg:
            tg.start_soon(provider.run)
            with anyio.fail_after(10):
                await link.ready.wait()
                answers = [await link.request_quote(r) for r in requests]  # one at a time
            tg.cancel_scope.cancel()
    return answers


STALL = QuoteRequest("stall", "tiny", 100, 10, session_id="session-secret")


async def test_a_callback_past_the_timeout_is_cancelled_and_declined_once(
    engine: HTTPServer, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = Stalling()
    with caplog.at_level(logging.DEBUG, logger="canopyx_provider"):
        stalled, after = await ask(engine, strategy, STALL, QuoteRequest("after", "tiny", 1, 1))

    assert stalled == QuoteAnswer("stall", None, "quote_timeout")
    assert strategy.cancelled.is_set()  # the callback's work was cancelled, not left running
    assert strategy.finished == ["after"]
    assert after == QuoteAnswer("after", LIST, None)  # the connector goes on answering

    timeouts = [r for r in caplog.records if "quote_timeout" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in timeouts] == [
        (
            logging.WARNING,
            "quote stall declined (quote_timeout): the pricing callback took longer than 50 ms",
        )
    ]
    assert "k-engine-secret" not in caplog.text and "session-secret" not in caplog.text


async def test_a_plain_callback_that_overruns_is_declined_when_it_returns(
    engine: HTTPServer,
) -> None:
    stalled, after = await ask(engine, Overrunning(), STALL, QuoteRequest("after", "tiny", 1, 1))
    assert stalled == QuoteAnswer("stall", None, "quote_timeout")
    assert after == QuoteAnswer("after", LIST, None)


# Neither reads the metrics: a collection slower than the 50 ms bound must not decline these.
@pytest.mark.parametrize("strategy", [Stalling(), Overrunning()], ids=["async", "plain"])
async def test_fast_callbacks_are_unaffected_by_the_timeout(
    engine: HTTPServer, strategy: PricingStrategy
) -> None:
    requests = [QuoteRequest(f"q{i}", "tiny", 100, 10) for i in range(5)]
    answers = await ask(engine, strategy, *requests)
    assert answers == [QuoteAnswer(r.request_id, LIST, None) for r in requests]
