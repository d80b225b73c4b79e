"""Pricing strategies: quote callbacks that read the latest snapshot and never do I/O."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from decimal import ROUND_HALF_UP, Decimal
from typing import Protocol

from ._errors import ConfigError
from ._snapshot import Capacity, EngineKind, EngineMetrics, SupportLevel

__all__ = [
    "CanopyCounts",
    "Decline",
    "LoadAndAdmission",
    "Price",
    "PricingStrategy",
    "QuoteContext",
    "QuoteRequest",
]

_MICRO = Decimal("0.000001")


@dataclass(frozen=True, slots=True)
class Price:
    """A price in currency units per million tokens. ``detail``, like a `Decline`'s, says
    why, and stays on this machine (a quote answer carries the amounts only); two prices with
    the same amounts are equal whatever their details."""

    input_per_mtok: Decimal
    output_per_mtok: Decimal
    detail: str | None = field(default=None, compare=False)

    def scaled(self, factor: Decimal) -> Price:
        return Price(
            (self.input_per_mtok * factor).quantize(_MICRO, ROUND_HALF_UP),
            (self.output_per_mtok * factor).quantize(_MICRO, ROUND_HALF_UP),
        )


@dataclass(frozen=True, slots=True)
class Decline:
    """A refusal to quote. ``code`` may leave the machine; ``detail`` stays on it."""

    code: str
    detail: str


@dataclass(frozen=True, slots=True)
class QuoteRequest:
    """What Canopy asks a price for."""

    request_id: str
    model_id: str
    prompt_tokens: int
    max_output_tokens: int
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class CanopyCounts:
    """Canopy's own activity on this provider (may overlap the engine's counts)."""

    active_requests: int = 0
    pending_quotes: int = 0
    idle_cached_sessions: int = 0


@dataclass(frozen=True, slots=True)
class QuoteContext:
    """Everything a quote callback may read. ``metrics`` and ``collected_at`` are both None
    when collection failed or the snapshot went stale."""

    engine: EngineKind
    support: SupportLevel
    metrics: EngineMetrics | None
    collected_at: float | None
    capacity: Capacity | None
    counts: CanopyCounts


class PricingStrategy(Protocol):
    """A provider's pricing: a list price to publish and a per-request quote callback."""

    @property
    def list_price(self) -> Price: ...

    def quote(
        self, request: QuoteRequest, context: QuoteContext
    ) -> Price | Decline | Awaitable[Price | Decline]:
        """Price ``request`` from ``context`` alone, without I/O.

        It may be ``async def``. Either way the connector declines the quote (``quote_timeout``)
        when the callback takes longer than ``request_timeout_ms``, and cancels an async one
        still running.
        """
        ...


class LoadAndAdmission:
    """Admit below a target under the engine's ceiling, and charge more as it fills.

    Supported engines are judged by KV (or slot) usage and their own queue: nothing is admitted
    while the engine has requests waiting (unless ``max_engine_waiting`` allows it) or once
    usage reaches ``admission_target``. The price rises linearly with usage, up to
    ``1 + surge`` times the list price at the target. An engine that publishes no waiting count
    is priced without it (never as if nothing waited), and the price's detail says so. Engines
    with no load metrics are judged by Canopy's own counts against ``limited_max_concurrent``,
    a deliberately small limit: work the engine serves outside Canopy is invisible to it.

    Args:
        list_price: the price at an idle engine.
        admission_target: fraction (0..1] of the engine's ceiling to admit up to.
        surge: extra price, as a fraction of the list price, at the admission target.
        max_engine_waiting: requests the engine may have queued and still be quoted.
        limited_max_concurrent: Canopy requests (active + pending quotes) admitted on an
            engine that publishes no load.
    """

    def __init__(
        self,
        list_price: Price,
        *,
        admission_target: float = 0.8,
        surge: float = 1.0,
        max_engine_waiting: int = 0,
        limited_max_concurrent: int = 2,
    ) -> None:
        if not 0 < admission_target <= 1:
            raise ConfigError(f"admission_target must be in (0, 1], got {admission_target}")
        if surge < 0 or max_engine_waiting < 0 or limited_max_concurrent < 1:
            raise ConfigError("surge and max_engine_waiting must be >= 0, limits >= 1")
        self._list = list_price
        self.admission_target = admission_target
        self.surge = surge
        self.max_engine_waiting = max_engine_waiting
        self.limited_max_concurrent = limited_max_concurrent

    @property
    def list_price(self) -> Price:
        return self._list

    def quote(self, request: QuoteRequest, context: QuoteContext) -> Price | Decline:
        m = context.metrics
        if m is None or context.collected_at is None:
            return Decline("no_metrics", "no fresh engine snapshot: collection failed or is stale")
        if not m.has_engine_load:
            load = context.counts.active_requests + context.counts.pending_quotes
            limit = self.limited_max_concurrent
            if load >= limit:
                return Decline("at_limit", f"{load} Canopy requests reach the limit of {limit}")
            return self._price(load / limit, f"{load} Canopy requests of the limit of {limit}")
        waiting = m.waiting_requests
        if waiting is not None and waiting > self.max_engine_waiting:
            return Decline("engine_queue", f"the engine has {waiting} requests waiting")
        usage = _usage(m, context.capacity)
        if usage is None:
            return Decline("no_usage", "the engine publishes no KV, slot or concurrency usage")
        if usage >= self.admission_target:
            return Decline(
                "over_target", f"usage {usage:.3f} reaches the target {self.admission_target}"
            )
        detail = f"usage {usage:.3f} of the target {self.admission_target}"
        if waiting is None:
            detail += "; priced without the engine's queue: it publishes no waiting count"
        return self._price(usage / self.admission_target, detail)

    def _price(self, fill: float, detail: str) -> Price:
        price = self._list.scaled(Decimal(1) + Decimal(str(round(self.surge * fill, 6))))
        return replace(price, detail=detail)

    def __repr__(self) -> str:
        return (
            f"<LoadAndAdmission target={self.admission_target} surge={self.surge} "
            f"limited_max={self.limited_max_concurrent}>"
        )


def _usage(m: EngineMetrics, capacity: Capacity | None) -> float | None:
    """The fullest of the engine's published fill levels."""
    levels = [r for r in (m.kv_cache_usage_ratio, m.slot_usage_ratio) if r is not None]
    ceiling = capacity.max_running_requests if capacity is not None else None
    if ceiling and m.running_requests is not None:
        levels.append(min(1.0, m.running_requests / ceiling))
    return max(levels) if levels else None
