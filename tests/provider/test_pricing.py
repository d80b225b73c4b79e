from __future__ import annotations

from decimal import Decimal

import pytest

from canopyx_provider import (
    CanopyCounts,
    Capacity,
    ConfigError,
    Decline,
    EngineKind,
    EngineMetrics,
    LoadAndAdmission,
    Price,
    QuoteAnswer,
    QuoteContext,
    QuoteRequest,
    SupportLevel,
)

LIST = Price(Decimal("0.20"), Decimal("0.60"))
REQ = QuoteRequest("q1", "m", prompt_tokens=100, max_output_tokens=50)


def ctx(
    metrics: EngineMetrics | None,
    *,
    counts: CanopyCounts | None = None,
    capacity: Capacity | None = None,
    support: SupportLevel = SupportLevel.SUPPORTED,
) -> QuoteContext:
    return QuoteContext(
        engine=EngineKind.VLLM,
        support=support,
        metrics=metrics,
        collected_at=None if metrics is None else 1.0,
        capacity=capacity,
        counts=counts or CanopyCounts(),
    )


def test_no_usable_metrics_declines() -> None:
    out = LoadAndAdmission(LIST).quote(REQ, ctx(None))
    assert isinstance(out, Decline) and out.code == "no_metrics"


def test_idle_engine_gets_the_list_price() -> None:
    m = EngineMetrics(running_requests=0, waiting_requests=0, kv_cache_usage_ratio=0.0)
    assert LoadAndAdmission(LIST).quote(REQ, ctx(m)) == LIST


def test_price_rises_with_kv_usage_up_to_the_target() -> None:
    strategy = LoadAndAdmission(LIST, admission_target=0.8, surge=1.0)
    prices = []
    for usage in (0.0, 0.2, 0.4, 0.6, 0.79):
        m = EngineMetrics(running_requests=1, waiting_requests=0, kv_cache_usage_ratio=usage)
        out = strategy.quote(REQ, ctx(m))
        assert isinstance(out, Price)
        prices.append(out.output_per_mtok)
    assert prices == sorted(prices) and prices[0] == Decimal("0.60")
    assert prices[-1] < Decimal("1.20")
    at_target = EngineMetrics(running_requests=9, waiting_requests=0, kv_cache_usage_ratio=0.8)
    out = strategy.quote(REQ, ctx(at_target))
    assert isinstance(out, Decline) and out.code == "over_target"


def test_slot_usage_stands_in_for_kv_usage() -> None:
    half = EngineMetrics(running_requests=1, waiting_requests=0, slot_usage_ratio=0.5)
    full = EngineMetrics(running_requests=2, waiting_requests=0, slot_usage_ratio=1.0)
    strategy = LoadAndAdmission(LIST)
    assert isinstance(strategy.quote(REQ, ctx(half)), Price)
    assert isinstance(strategy.quote(REQ, ctx(full)), Decline)


def test_an_engine_queue_declines() -> None:
    m = EngineMetrics(running_requests=1, waiting_requests=3, kv_cache_usage_ratio=0.1)
    out = LoadAndAdmission(LIST).quote(REQ, ctx(m))
    assert isinstance(out, Decline) and out.code == "engine_queue"
    assert isinstance(LoadAndAdmission(LIST, max_engine_waiting=3).quote(REQ, ctx(m)), Price)


def test_running_against_a_known_ceiling_counts_as_usage() -> None:
    m = EngineMetrics(running_requests=90, waiting_requests=0, kv_cache_usage_ratio=0.1)
    out = LoadAndAdmission(LIST).quote(REQ, ctx(m, capacity=Capacity(max_running_requests=100)))
    assert isinstance(out, Decline) and out.code == "over_target"


def test_health_only_engines_are_priced_from_canopy_counts() -> None:
    no_load = EngineMetrics(has_engine_load=False)
    strategy = LoadAndAdmission(LIST, limited_max_concurrent=2)
    idle = strategy.quote(REQ, ctx(no_load, support=SupportLevel.LIMITED))
    one = strategy.quote(REQ, ctx(no_load, counts=CanopyCounts(active_requests=1)))
    full = strategy.quote(REQ, ctx(no_load, counts=CanopyCounts(1, 1, 0)))
    assert idle == LIST
    assert isinstance(one, Price) and one.input_per_mtok > LIST.input_per_mtok
    assert isinstance(full, Decline) and full.code == "at_limit"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"admission_target": 0.0},
        {"admission_target": 1.5},
        {"surge": -1},
        {"limited_max_concurrent": 0},
    ],
)
def test_bad_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        LoadAndAdmission(LIST, **kwargs)  # type: ignore[arg-type]


def test_a_missing_waiting_count_is_left_out_of_the_price_never_taken_as_zero() -> None:
    # llama.cpp without its deferred gauge, for one: running and slots, no waiting count.
    unknown = EngineMetrics(running_requests=1, slot_usage_ratio=0.4)
    known = EngineMetrics(running_requests=1, waiting_requests=0, slot_usage_ratio=0.4)
    strategy = LoadAndAdmission(LIST)
    out, same_load = strategy.quote(REQ, ctx(unknown)), strategy.quote(REQ, ctx(known))
    assert isinstance(out, Price) and isinstance(same_load, Price)
    assert out == same_load  # the same amounts: usage alone prices it
    assert out.detail is not None and "no waiting count" in out.detail
    assert same_load.detail is not None and "waiting" not in same_load.detail


def test_a_prices_detail_stays_on_the_machine() -> None:
    priced = Price(Decimal("0.20"), Decimal("0.60"), detail="usage 0.000 of the target 0.8")
    sent = QuoteAnswer.of(REQ, priced)
    assert sent.price is not None
    assert sent.price == priced and sent.price.detail is None
