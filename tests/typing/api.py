"""Type-checked (by mypy), never run: the public API as a user would write against it."""

from __future__ import annotations

from decimal import Decimal

import aiohttp

from canopyx_provider import (
    AiohttpFetcher,
    CanopyCounts,
    Collector,
    Decline,
    EngineAdapter,
    EngineKind,
    EngineSnapshot,
    Event,
    Fetcher,
    InProcessLink,
    LoadAndAdmission,
    Price,
    PricingStrategy,
    Provider,
    ProviderOptions,
    QuoteContext,
    QuoteRequest,
    ScrapeFailed,
    adapter_for,
    engine_api_key,
    llama_cpp,
    sglang,
    vllm,
)


class Flat:
    list_price = Price(Decimal("0.20"), Decimal("0.60"))

    def quote(self, request: QuoteRequest, context: QuoteContext) -> Price | Decline:
        if context.metrics is None:
            return Decline("no_metrics", "no fresh snapshot")
        return self.list_price


class Waiting:
    """An async quote callback: bounded by request_timeout_ms like a plain one."""

    list_price = Price(Decimal("0.20"), Decimal("0.60"))

    async def quote(self, request: QuoteRequest, context: QuoteContext) -> Price | Decline:
        return self.list_price


def hook(event: Event, /) -> None:
    if isinstance(event, ScrapeFailed):
        seen: tuple[str, str] = (event.check, event.error.message)
        del seen


async def use() -> None:
    strategy: PricingStrategy = LoadAndAdmission(Price(Decimal(1), Decimal(2)))
    flat: PricingStrategy = Flat()
    waiting: PricingStrategy = Waiting()
    options = ProviderOptions(poll_interval_ms=500)
    async with Collector(options=options, hooks=[hook]) as collector:
        collector.add("a", vllm("http://127.0.0.1:8000", api_key=engine_api_key()), model_id="m")
        collector.add("b", sglang("http://127.0.0.1:30000", labels={"dp_rank": "0"}), model_id="m")
        collector.add("c", llama_cpp("http://127.0.0.1:8080", router=True), model_id="m")
        by_kind: EngineAdapter = adapter_for(EngineKind.LLAMACPP, "http://127.0.0.1:8081", slots=2)
        by_name: EngineAdapter = adapter_for("sglang", "http://127.0.0.1:30001", labels={"a": "b"})
        collector.add("d", by_kind, model_id="m")
        collector.add("e", by_name, model_id="m")
        snap: EngineSnapshot | None = collector.snapshot("a")
        if snap is not None:
            running: int | None = snap.metrics.running_requests
            fields: tuple[int | None, float, str | None] = (
                running,
                snap.collected_at,
                snap.engine_version,
            )
            del fields
    link = InProcessLink("m", counts=CanopyCounts(active_requests=1))
    provider = Provider(vllm("http://127.0.0.1:8000"), strategy, link, options=options)
    answer: Price | Decline = await provider.quote(QuoteRequest("q", "m", 10, 10))
    del answer, flat, waiting


async def use_aiohttp() -> None:
    options = ProviderOptions()
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        fetcher: Fetcher = AiohttpFetcher(session, timeout_s=options.request_timeout_s)
        async with Collector(options=options, fetcher=fetcher) as collector:
            collector.add("a", vllm("http://127.0.0.1:8000"), model_id="m")
