"""Engine answers that are not the answer asked for: an engine's own refusal (its status kept),
any other status, and a host's ingress that did not forward the request at all."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from yarl import URL

from .._engine_client import EngineConnectionError
from .._errors import EngineError, EngineRejectedError, NotAcceptedError
from .._log import masked
from .._machines.protocol import NOT_FORWARDED

if TYPE_CHECKING:
    from .exchange import Answer, Exchange

__all__ = [
    "MAX_ERROR_BODY",
    "REJECTION_STATUSES",
    "EngineRefusalError",
    "engine_message",
    "fit_for_client",
    "fit_for_log",
    "forwarded",
    "refusal",
]

REJECTION_STATUSES = frozenset({400, 413, 422})
"""An engine answering one of these refused the request itself: its status is kept."""
MAX_ERROR_BODY = 16 * 1024
_ADDRESS = re.compile(
    r"(?i)\b(?:[a-z][a-z0-9+.-]*://)?(?:(?:\d{1,3}\.){3}\d{1,3}|localhost)(?::\d+)?\b"
    r"|(?:[a-z][a-z0-9+.-]*://)?\[[0-9a-f:.]+\](?::\d+)?"
)
"""An IP address or ``localhost``, with its scheme and port where written: an address an
engine's words may name (its own, its host's), never a client's to read."""


class EngineRefusalError(EngineRejectedError):
    """An engine's refusal as it said it (``said``, whole), on its way to the exchange, which
    answers the client an `EngineRejectedError` of it fit for a client (`fit_for_client`).
    Its own message says nothing of the engine's words, so no traceback carries them."""

    def __init__(self, status: int, said: str) -> None:
        super().__init__(status, "")
        self.said = said


def fit_for_log(said: str, headers: Mapping[str, str]) -> str:
    """An engine's words with the engine key the gateway sends it (in ``headers``) masked, and
    whatever `masked` masks: the log names addresses, never keys."""
    return masked(said, [_key(headers)])


def fit_for_client(said: str, headers: Mapping[str, str], url: URL) -> str:
    """An engine's words with what a client must never read masked: the engine key the gateway
    sends it (in ``headers``), its address (``url``: whole, as host:port and, where it is an
    address or a dotted name, its host) and any IP address, and whatever `masked` masks."""
    secrets = [_key(headers), str(url.origin()), f"{url.host}:{url.port}"]
    host = url.host or ""
    if "." in host or ":" in host or host == "localhost":
        secrets.append(host)
    return _ADDRESS.sub("***", masked(said, secrets))


def _key(headers: Mapping[str, str]) -> str:
    """The engine key in the ``Authorization`` header the gateway sends its engine ("")."""
    return headers.get("Authorization", "").partition(" ")[2]


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
            return EngineRefusalError(resp.status, engine_message(raw))
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
