"""What the collector knows about one engine: frozen, validated, freshness-checked."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "Capacity",
    "CheckName",
    "CheckReport",
    "CheckResult",
    "EngineKind",
    "EngineMetrics",
    "EngineSnapshot",
    "SupportLevel",
]


class EngineKind(StrEnum):
    """The engines an adapter exists for."""

    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"
    OLLAMA = "ollama"
    MLX = "mlx"
    TABBYAPI = "tabbyapi"
    TENSORFOLD = "tensorfold"


class SupportLevel(StrEnum):
    """How much an adapter can tell about its engine."""

    SUPPORTED = "supported"
    """Health, models, load and KV or slot metrics, capacity."""
    LIMITED = "limited"
    """Health and models only: no engine load is published."""
    HEALTH_LOAD = "health_load"
    """Load read from the health endpoint (TensorFold), for the gateway."""


_FROZEN = ConfigDict(frozen=True, extra="forbid")


class EngineMetrics(BaseModel):
    """Load figures of one engine. A figure the engine does not publish is None, never 0."""

    model_config = _FROZEN

    running_requests: int | None = None
    waiting_requests: int | None = None
    kv_cache_usage_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    slot_usage_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    prompt_tokens_total: float | None = None
    """Raw cumulative count as published; it falls when the engine restarts."""
    generated_tokens_total: float | None = None
    """Raw cumulative count as published; it falls when the engine restarts."""
    prefix_cache_queried_tokens_total: float | None = None
    """Prompt tokens the engine looked up in its prefix cache (raw cumulative count, falls when
    the engine restarts): vLLM's ``prefix_cache_queries``; llama.cpp's prompt tokens, cached
    and not."""
    prefix_cache_hit_tokens_total: float | None = None
    """Of those, the tokens it found cached (vLLM's ``prefix_cache_hits``, llama.cpp's
    ``prompt_tokens_cached``)."""
    busy: bool | None = None
    """TensorFold's own busy flag."""
    has_engine_load: bool = True
    """False for health-only engines: no figure above describes engine-wide load."""

    def figures(self) -> dict[str, float | int | bool]:
        """The published figures only, by their snake_case names."""
        return {
            k: v for k, v in self.model_dump(exclude={"has_engine_load"}).items() if v is not None
        }

    @property
    def idle(self) -> bool | None:
        """True when the engine reports nothing running and nothing waiting; None when unknown."""
        if self.running_requests is None:
            return None
        if self.running_requests != 0 or self.busy is True:
            return False
        # An engine that publishes no waiting gauge (TensorFold) is judged by what it publishes.
        return self.waiting_requests in (0, None)


class Capacity(BaseModel):
    """What the engine says it can hold, read on each connection. Unknown figures are None."""

    model_config = _FROZEN

    kv_cache_tokens: int | None = None
    total_slots: int | None = None
    max_running_requests: int | None = None
    notes: tuple[str, ...] = ()
    """Why a figure is absent, e.g. that vLLM publishes no sequence limit."""

    def figures(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v not in (None, ())}


class EngineSnapshot(BaseModel):
    """One successful collection from one engine."""

    model_config = _FROZEN

    engine: EngineKind
    model_id: str
    metrics: EngineMetrics
    capacity: Capacity | None
    engine_version: str | None
    requested_at: float
    """Wall-clock time (s) the collection began: the sample was taken after this instant."""
    collected_at: float
    """Wall-clock time (s) the last answer of the collection arrived."""
    process_start: float | None = None
    """The engine's process start marker where it publishes one (changes on restart)."""

    def age_s(self, now: float) -> float:
        return max(0.0, now - self.collected_at)

    def is_fresh(self, now: float, max_age_s: float) -> bool:
        return self.age_s(now) <= max_age_s

    def __repr__(self) -> str:
        return (
            f"<EngineSnapshot {self.engine.value} {self.model_id!r} "
            f"collected_at={self.collected_at:.3f} {self.metrics.figures()}>"
        )


CheckName = Literal["health", "models", "discovery", "metrics"]


class CheckResult(BaseModel):
    """The outcome of one startup check."""

    model_config = _FROZEN

    name: CheckName
    ok: bool
    reason: str | None = None
    code: str | None = None
    """A fixed failure code without engine figures; see ``error_code``."""


class CheckReport(BaseModel):
    """The startup checks of one engine, in order, and what they found."""

    model_config = _FROZEN

    checks: tuple[CheckResult, ...]
    metrics: EngineMetrics | None = None
    capacity: Capacity | None = None
    engine_version: str | None = None

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def failed(self) -> CheckResult | None:
        return next((c for c in self.checks if not c.ok), None)

    def to_dict(self) -> dict[str, Any]:
        """The documented ``check --json`` object, as a dict of JSON types (lists, not tuples)."""
        capacity = None
        if self.capacity is not None:
            capacity = {
                k: list(v) if isinstance(v, tuple) else v
                for k, v in self.capacity.figures().items()
            }
        return {
            "checks": [c.model_dump(exclude={"code"}) for c in self.checks],
            "metrics": self.metrics.figures() if self.metrics is not None else None,
            "capacity": capacity,
            "engine_version": self.engine_version,
        }

    def to_json(self, *, indent: int | None = None) -> str:
        """The documented ``check --json`` object, as JSON text (what the CLI prints)."""
        return json.dumps(self.to_dict(), indent=indent)
