"""Per-request figures: the engine's own where it measured them, the gateway's otherwise.

Each figure is ``{"value": v, "source": "engine" | "router"}``, rounded to three decimals. A
figure nobody measured is left out, never shown as zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._engines import FACTS, EngineKind

__all__ = ["Figures", "chat_figures", "num", "put"]

Figures = dict[str, dict[str, Any]]


def num(value: Any) -> float | None:
    """A JSON number as given (a count stays an integer); None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def put(out: Figures, name: str, value: float | None, source: str) -> None:
    if value is not None and name not in out:
        out[name] = {"value": round(value, 3), "source": source}


def chat_figures(
    family: EngineKind,
    *,
    engine_objects: dict[str, Any],
    usage: dict[str, Any] | None,
    sent_at: float,
    first_text_at: float | None,
    last_at: float | None,
) -> Figures:
    """The figures of one chat answer. Times are ``loop.time()`` seconds."""
    out: Figures = {}
    key = FACTS[family].figures_in
    found = engine_objects.get(key) if key is not None else None
    if key is not None and isinstance(found, dict):
        _ENGINE_FIGURES[key](found, out)
    cached = _cached_tokens(family, usage)
    put(out, "cached_tokens", cached, "engine")
    if first_text_at is not None:
        put(out, "ttft_ms", (first_text_at - sent_at) * 1000, "router")
        tokens = _completion_tokens(usage, engine_objects)
        if tokens is not None and tokens >= 2 and last_at is not None and last_at > first_text_at:
            put(out, "decode_tokens_per_second", (tokens - 1) / (last_at - first_text_at), "router")
    return dict(sorted(out.items()))


def _cached_tokens(family: EngineKind, usage: dict[str, Any] | None) -> float | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details")
    cached = num(details.get("cached_tokens")) if isinstance(details, dict) else None
    if FACTS[family].cached_only_when_some and not cached:
        return None  # a count it gives only when some were cached: none says nothing
    return cached


def _vllm_metrics(m: dict[str, Any], out: Figures) -> None:
    """vLLM's per-request ``metrics`` (``--enable-per-request-metrics``)."""
    queue, ttft = num(m.get("queue_time_ms")), num(m.get("time_to_first_token_ms"))
    if queue is not None and ttft is not None:
        put(out, "ttft_ms", queue + ttft, "engine")
    put(out, "queue_ms", queue, "engine")
    put(out, "prefill_ms", ttft, "engine")
    itl = num(m.get("mean_itl_ms"))
    if itl is not None and itl > 0:
        put(out, "decode_tokens_per_second", 1000.0 / itl, "engine")


def _tensorfold(t: dict[str, Any], out: Figures) -> None:
    """TensorFold's ``tensorfold`` object (seconds). On CUDA Qwen models it carries
    ``prefill_s`` (from when the engine started the request) and no figure of its own for the
    time to first token or the decode speed, which the router times (the product guide's
    table: no recorded answer confirms this shape)."""
    qwen = num(t.get("prefill_s"))
    if qwen is not None:
        put(out, "prefill_ms", qwen * 1000, "engine")
        return
    ttft, prefill = num(t.get("time_to_first_token")), num(t.get("prefill_seconds"))
    put(out, "ttft_ms", None if ttft is None else ttft * 1000, "engine")
    put(out, "prefill_ms", None if prefill is None else prefill * 1000, "engine")
    tps = num(t.get("tokens_per_second"))
    put(out, "decode_tokens_per_second", tps if tps and tps > 0 else None, "engine")


def _llamacpp_timings(t: dict[str, Any], out: Figures) -> None:
    """llama.cpp's ``timings`` (milliseconds, tokens per second; ``cache_n``, the prompt tokens
    it took from its cache, is there with usage or without)."""
    put(out, "cached_tokens", num(t.get("cache_n")), "engine")
    put(out, "prefill_ms", num(t.get("prompt_ms")), "engine")
    tps = num(t.get("predicted_per_second"))
    put(out, "decode_tokens_per_second", tps if tps and tps > 0 else None, "engine")


_ENGINE_FIGURES: dict[str, Callable[[dict[str, Any], Figures], None]] = {
    "metrics": _vllm_metrics,
    "tensorfold": _tensorfold,
    "timings": _llamacpp_timings,
}
"""How each engine figures object is read, keyed as `EngineFacts.figures_in` names it."""


def _completion_tokens(usage: dict[str, Any] | None, objects: dict[str, Any]) -> float | None:
    if usage is not None:
        n = num(usage.get("completion_tokens"))
        if n is not None:
            return n
    timings = objects.get("timings")
    return num(timings.get("predicted_n")) if isinstance(timings, dict) else None
