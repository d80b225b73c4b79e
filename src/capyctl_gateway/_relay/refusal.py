"""Engine answers that are not the answer asked for: an engine's own refusal (its status kept),
any other status, and a host's ingress that did not forward the request at all."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from .._engine_client import EngineConnectionError
from .._errors import EngineError, EngineRejectedError, NotAcceptedError
from .._machines.protocol import NOT_FORWARDED

if TYPE_CHECKING:
    from .exchange import Answer, Exchange

__all__ = [
    "MAX_ERROR_BODY",
    "REJECTION_STATUSES",
    "engine_message",
    "forwarded",
    "refusal",
]

REJECTION_STATUSES = frozenset({400, 413, 422})
"""An engine answering one of these refused the request itself: its status is kept."""
MAX_ERROR_BODY = 16 * 1024


def forwarded(ex: Exchange, resp: Answer) -> None:
    """Raise NotAcceptedError for an answer a host's ingress gave without forwarding the
    request to its engine (another instance may take it)."""
    if NOT_FORWARDED in resp.headers:
        ex.outcome.sent = False
        ex.outcome.completed = True
        detail = f"the host's ingress: {resp.headers[NOT_FORWARDED]}"
        raise NotAcceptedError(f"{ex.where} could not be reached", detail=detail)


async def refusal(resp: Answer, where: str, raw: bytes | None = None) -> EngineError:
    """The error for an engine's non-200 answer: its own refusals keep their status."""
    if resp.status in REJECTION_STATUSES and "json" in resp.headers.get("Content-Type", ""):
        if raw is None:
            try:
                raw = await asyncio.wait_for(resp.content.read(MAX_ERROR_BODY), 5)
            except (TimeoutError, aiohttp.ClientError, EngineConnectionError):
                raw = b""
        if raw:
            return EngineRejectedError(resp.status, engine_message(raw))
    return EngineError(
        f"{where}: the engine answered HTTP {resp.status}", detail=f"status {resp.status}"
    )


def engine_message(raw: bytes) -> str:
    """The message of an engine's JSON refusal ("" when it has none)."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return ""
    message: Any = None
    if isinstance(doc, dict):
        err = doc.get("error")
        message = err.get("message") if isinstance(err, dict) else doc.get("message")
        if message is None and isinstance(err, str):
            message = err
    return str(message) if message is not None else ""
