"""Turning a `GatewayError` into what the client receives, in one place.

Before anything was written an error is an HTTP answer with the documented JSON body, the
request's IDs and, for a 429, ``Retry-After`` (for a 401, ``WWW-Authenticate: Bearer``). An
error marked in band (the client asked for a stream) is a ``200`` event stream that tells it in
its API's form instead (`InBand`: chat's one error event by default). What only the log may see
(``detail``) is logged here with the request ID, never sent.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from .._errors import ClientGoneError, GatewayError, error_body
from .._relay.chat import stream_error

__all__ = ["InBand", "answer", "chat_in_band", "error_response"]

logger = logging.getLogger("capyctl_gateway")

InBand = Callable[[web.Request, GatewayError, dict[str, str]], Awaitable[web.StreamResponse]]
"""How an error is told on the stream a client asked for, before anything was written."""


async def chat_in_band(
    request: web.Request, err: GatewayError, headers: dict[str, str]
) -> web.StreamResponse:
    """Chat's form: one error event."""
    return await stream_error(request, None, err, headers)


def error_response(err: GatewayError, headers: dict[str, str]) -> web.Response:
    """The HTTP answer for ``err`` (nothing of it was sent yet)."""
    h = dict(headers)
    if err.status == 429:
        h["Retry-After"] = "1"
    elif err.status == 401:  # how to authenticate (RFC 6750): the key as a bearer token
        h["WWW-Authenticate"] = "Bearer"
    return web.Response(
        status=err.status, body=error_body(err), headers=h, content_type="application/json"
    )


async def answer(
    request: web.Request,
    err: GatewayError,
    headers: dict[str, str],
    rid: str,
    in_band: InBand = chat_in_band,
    shape: Callable[[GatewayError, dict[str, str]], web.Response] = error_response,
) -> web.StreamResponse:
    """Answer ``err`` for the request ``rid`` (over HTTP in its API's error ``shape``), logging
    what the client is not told."""
    if err.detail is not None:
        logger.warning("request %s: %s (%s)", rid, err.message, err.detail)
    if isinstance(err, ClientGoneError):
        return web.Response(status=499)
    if err.in_band:
        return await in_band(request, err, headers)
    resp = shape(err, headers)
    if not request.content.is_eof():
        # The body was not read to its end (too large, too slow): the connection cannot carry
        # another request, and waiting for the rest would hold it for nothing.
        resp.force_close()
    return resp
