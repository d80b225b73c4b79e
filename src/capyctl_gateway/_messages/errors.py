"""Every refusal of the Messages API in Anthropic's shape (pure but for the aiohttp answer).

``{"type": "error", "error": {"type": ..., "message": ...}, "request_id": ...}``, the error's
type by its status as Anthropic's API reference lists them. The gateway's own code leads the
message (``unknown_model: no deployment serves ...``), as a Responses failure's does: Anthropic's
error object has no room for it. What the gateway would answer 503 (a deadline, no slot, the
gateway stopping) is Anthropic's 529 ``overloaded_error``, which its clients retry. A status
Anthropic does not list keeps its number with the nearest type: 405, 408, 409 and an engine's
422 are ``invalid_request_error``, 502 is ``api_error``. On a stream the same object is one
``event: error``.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from .._errors import GatewayError
from .._ulid import REQUEST_ID

__all__ = ["ERROR_TYPES", "error_event", "error_type", "messages_error", "status_of"]

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
"""Anthropic's error types by status."""
_NEAREST = {405: 400, 408: 400, 409: 400, 422: 400, 503: 529}


def status_of(err: GatewayError) -> int:
    """The status the client is answered with: the gateway's, but 503 is 529."""
    return 529 if err.status == 503 else err.status


def error_type(status: int) -> str:
    """Anthropic's type for ``status`` (one it does not list: its nearest; else api_error)."""
    return ERROR_TYPES.get(_NEAREST.get(status, status), "api_error")


def _object(err: GatewayError, rid: str | None) -> bytes:
    inner = {"type": error_type(err.status), "message": f"{err.code}: {err.message}"}
    body = {"type": "error", "error": inner}
    if rid is not None:
        body["request_id"] = rid
    return orjson.dumps(body)


def messages_error(err: GatewayError, headers: dict[str, str]) -> web.Response:
    """The HTTP answer for ``err`` (nothing of it was sent yet), with the request's IDs."""
    h = dict(headers)
    if err.status == 429:
        h["Retry-After"] = "1"
    elif err.status == 401:
        h["WWW-Authenticate"] = "Bearer"
    body = _object(err, headers.get(REQUEST_ID))
    return web.Response(
        status=status_of(err), body=body, headers=h, content_type="application/json"
    )


def error_event(err: GatewayError, rid: str | None = None) -> bytes:
    """The in-band form, once a stream has started (or where a stream was asked for)."""
    return b"event: error\ndata: " + _object(err, rid) + b"\n\n"
