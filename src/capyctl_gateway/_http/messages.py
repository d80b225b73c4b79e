"""Anthropic's Messages API as two surfaces of the public listener: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``, for every chat deployment.

Each is chat's path through the listener (`Inference`): the key (as ``x-api-key`` or a bearer
token), Anthropic's headers, the body, the checks (``_messages/``), the queue, an instance, an
exchange; its refusals in Anthropic's shape. A whole Message's figures travel in the
``X-CapyCTL-Metrics`` header (a Message has no room for them), a stream's in the comment line
before its end, as on chat.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import orjson
from aiohttp import web

from .._config import Api, Deployment
from .._messages.count import check_tokens, count_tokens
from .._messages.errors import messages_error
from .._messages.headers import check_headers
from .._messages.relay import collect_message, refuse_message, relay_message
from .._messages.request import check_messages
from .._relay.exchange import Exchange
from .answers import InBand
from .calls import Call
from .inference import Checked, Surface

__all__ = ["COUNT_TOKENS", "MESSAGES", "METRICS_HEADER"]

METRICS_HEADER = "X-CapyCTL-Metrics"
_JSON = "application/json"


async def _message(call: Call, ex: Exchange, cap: int) -> web.StreamResponse:
    if call.stream:
        return await relay_message(
            call.request,
            ex,
            call.dep,
            call.payload,
            headers=call.headers,
            asked=call.notes,
            cap=cap,
        )
    body, figures = await collect_message(ex, call.dep, call.payload, asked=call.notes, cap=cap)
    headers = {**call.headers, METRICS_HEADER: orjson.dumps(figures).decode()}
    return web.Response(body=body, headers=headers, content_type=_JSON)


async def _count(call: Call, ex: Exchange, cap: int) -> web.StreamResponse:
    body = await count_tokens(ex, call.dep, call.payload, cap=cap)
    return web.Response(body=body, headers=call.headers, content_type=_JSON)


def _check_messages(body: dict[str, Any], dep: Deployment) -> Checked:
    return check_messages(body, dep)


def _check_count(body: dict[str, Any], dep: Deployment) -> Checked:
    return check_tokens(body, dep), False, None  # a count is answered whole


def _in_band(dep: Deployment, notes: Any) -> InBand:
    return refuse_message


MESSAGES = Surface(
    "messages",
    "/v1/messages",
    Api.CHAT,
    attrgetter("limits.max_body_bytes"),
    _check_messages,
    attrgetter("chat_url"),
    _message,
    _in_band,
    shape=messages_error,
    key_header="x-api-key",
    admit=check_headers,
)
COUNT_TOKENS = Surface(
    "count_tokens",
    "/v1/messages/count_tokens",
    Api.CHAT,
    attrgetter("limits.max_body_bytes"),
    _check_count,
    attrgetter("chat_url"),  # the exchange posts to the engine's tokenizer beside it
    _count,
    _in_band,
    shape=messages_error,
    key_header="x-api-key",
    admit=check_headers,
)
