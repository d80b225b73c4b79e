"""A decision answer on ``POST /v1/systemone``: forwarded whole, answered whole."""

from __future__ import annotations

from typing import Any

import orjson

from .. import _clock
from .._errors import EngineError
from .exchange import Exchange
from .figures import Figures, num, put
from .refusal import forwarded, refusal

__all__ = ["decision_figures", "relay_decision"]


def decision_figures(
    answer: dict[str, Any], *, arrival: float, sent_at: float, now: float
) -> Figures:
    out: Figures = {}
    put(out, "total_ms", (now - arrival) * 1000, "router")
    put(out, "time_to_response_ms", (now - sent_at) * 1000, "router")
    usage = answer.get("usage")
    if isinstance(usage, dict):
        put(out, "input_tokens", num(usage.get("input_tokens")), "engine")
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        if isinstance(details, dict):
            put(out, "cached_tokens", num(details.get("cached_tokens")), "engine")
    m = answer.get("metrics")
    if isinstance(m, dict):  # vLLM-style per-request metrics
        put(out, "queue_ms", num(m.get("queue_time_ms")), "engine")
        put(out, "prefill_ms", num(m.get("time_to_first_token_ms")), "engine")
    t = answer.get("tensorfold")
    if isinstance(t, dict):
        prefill = num(t.get("prefill_seconds"))
        put(out, "prefill_ms", None if prefill is None else prefill * 1000, "engine")
        queue = num(t.get("queue_seconds"))
        put(out, "queue_ms", None if queue is None else queue * 1000, "engine")
    return dict(sorted(out.items()))


def _answer(raw: bytes, where: str, max_bytes: int) -> dict[str, Any]:
    if len(raw) > max_bytes:
        raise EngineError(f"{where}: the engine's answer is over {max_bytes} bytes")
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise EngineError(f"{where}: the engine's answer is not JSON") from None
    if not isinstance(answer, dict):
        raise EngineError(f"{where}: the engine's answer is not a JSON object")
    return answer


async def relay_decision(
    ex: Exchange,
    payload: bytes,
    *,
    public: str,
    arrival: float,
    max_bytes: int,
    hide: bool = False,
) -> bytes:
    """Forward ``payload`` (addressed to the engine); return the client's answer's bytes
    (``hide``: without the engine's count of cached prompt tokens, or the figure of it)."""
    sent_at = _clock.now()
    async with ex:  # what the engine answered, refusals included, is judged inside it
        resp = await ex.post(payload)
        if resp.status != 200:
            forwarded(ex, resp)
        raw = await resp.content.read(max_bytes + 1)
        ex.complete()
        ex.outcome.last_at = _clock.now()
        if resp.status != 200:
            raise await refusal(resp, ex.where, raw)
        answer = _answer(raw, ex.where, max_bytes)
    answer["model"] = public
    figures = decision_figures(answer, arrival=arrival, sent_at=sent_at, now=_clock.now())
    if hide:
        _withhold_cached(answer, figures)
    answer["capyctl"] = {"metrics": figures}
    return orjson.dumps(answer)


def _withhold_cached(answer: dict[str, Any], figures: Figures) -> None:
    """Leave out of ``answer`` and its ``figures`` how many prompt tokens were cached."""
    figures.pop("cached_tokens", None)
    usage = answer.get("usage")
    if isinstance(usage, dict):
        for key in ("prompt_tokens_details", "input_tokens_details"):
            details = usage.get(key)
            if isinstance(details, dict):
                details.pop("cached_tokens", None)
