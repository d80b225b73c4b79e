"""Decision requests on ``POST /v1/systemone``: checked, forwarded whole, answered whole."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from ._config import Api, Deployment, GatewayConfig
from ._errors import GatewayError, invalid
from ._permetrics import Figures, _num, _put
from ._relay import (
    MAX_MESSAGE_BYTES,
    REJECTION_STATUSES,
    RelayContext,
    _engine_message,
    _gateway_error_response,
    post_to_engine,
)
from ._validate import resolve

__all__ = ["DECISION_FIELDS", "DecisionRequest", "parse_decision_request", "relay_decision"]

DECISION_FIELDS = frozenset({"model", "state", "questions", "images", "files"})
MAX_ANSWER_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class DecisionRequest:
    deployment: Deployment
    body: dict[str, Any]


def parse_decision_request(raw: bytes, config: GatewayConfig) -> DecisionRequest:
    """The documented checks, in order; the engine judges the rest."""
    body, deployment = resolve(raw, config, Api.DECISIONS)
    for key in body:
        if key not in DECISION_FIELDS:
            raise invalid(f"request field `{key}` is not accepted")
    for key in ("images", "files"):
        value = body.get(key)
        if value is not None and (
            not isinstance(value, list) or not all(isinstance(v, str) for v in value)
        ):
            raise invalid(f"{key} must be a list of data-URI strings")
    return DecisionRequest(deployment, body)


def decision_figures(
    answer: dict[str, Any], *, arrival: float, sent_at: float, now: float
) -> Figures:
    out: Figures = {}
    _put(out, "total_ms", (now - arrival) * 1000, "router")
    _put(out, "time_to_response_ms", (now - sent_at) * 1000, "router")
    usage = answer.get("usage")
    if isinstance(usage, dict):
        _put(out, "input_tokens", _num(usage.get("input_tokens")), "engine")
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        if isinstance(details, dict):
            _put(out, "cached_tokens", _num(details.get("cached_tokens")), "engine")
    m = answer.get("metrics")
    if isinstance(m, dict):  # vLLM-style per-request metrics
        _put(out, "queue_ms", _num(m.get("queue_time_ms")), "engine")
        _put(out, "prefill_ms", _num(m.get("time_to_first_token_ms")), "engine")
    t = answer.get("tensorfold")
    if isinstance(t, dict):
        prefill = _num(t.get("prefill_seconds"))
        _put(out, "prefill_ms", None if prefill is None else prefill * 1000, "engine")
        queue = _num(t.get("queue_seconds"))
        _put(out, "queue_ms", None if queue is None else queue * 1000, "engine")
    return dict(sorted(out.items()))


async def relay_decision(ctx: RelayContext, body: dict[str, Any]) -> web.Response:
    """Forward ``body`` (addressed to the engine) and answer with the engine's answer."""
    loop = asyncio.get_running_loop()
    upstream: aiohttp.ClientResponse | None = None
    clean = False
    sent_at = loop.time()
    try:
        async with asyncio.timeout_at(ctx.arrival + ctx.request_deadline):
            upstream = await post_to_engine(ctx, body)
            raw = await upstream.content.read(MAX_ANSWER_BYTES + 1)
        clean = True
        ctx.outcome.completed = True
        ctype = upstream.headers.get("Content-Type", "")
        if upstream.status in REJECTION_STATUSES and "json" in ctype:
            message = _engine_message(raw) or "rejected by the engine"
            raise GatewayError(upstream.status, "engine_rejected", message[:MAX_MESSAGE_BYTES])
        if upstream.status != 200 or len(raw) > MAX_ANSWER_BYTES:
            raise GatewayError(502, "engine_error", f"the engine answered {upstream.status}")
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise GatewayError(502, "engine_error", "the engine's answer is not JSON") from None
        if not isinstance(answer, dict):
            raise GatewayError(502, "engine_error", "the engine's answer is not a JSON object")
        answer["model"] = ctx.deployment.name
        answer["capyctl"] = {
            "metrics": decision_figures(
                answer, arrival=ctx.arrival, sent_at=sent_at, now=loop.time()
            )
        }
        return web.Response(
            body=orjson.dumps(answer), headers=ctx.response_headers, content_type="application/json"
        )
    except TimeoutError:
        ctx.outcome.cut = "deadline"
        err = GatewayError(
            503, "unavailable", "no answer within queue.request_deadline", retryable=True
        )
        return _gateway_error_response(err, ctx.response_headers)
    except GatewayError as err:
        return _gateway_error_response(err, ctx.response_headers)
    except aiohttp.ClientError as exc:
        ctx.outcome.error = str(exc)
        failure = GatewayError(502, "engine_error", f"the engine connection failed: {exc}")
        return _gateway_error_response(failure, ctx.response_headers)
    except asyncio.CancelledError:
        ctx.outcome.cut = "hang_up"
        raise
    finally:
        if upstream is not None:
            if clean:
                upstream.release()
            else:
                upstream.close()  # the engine sees the close
