"""The one shape of a management handler: the key checked first, a `GatewayError` turned into
its documented answer, a document answered as JSON; each answer with its own request ID."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from .._errors import GatewayError, UnauthorizedError
from .._gateway import Gateway
from .._http.answers import error_response
from .._ulid import REQUEST_ID, new_ulid

__all__ = ["Handler", "json_answer", "keyed"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_answer(doc: object, rid: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(doc),
        headers={REQUEST_ID: rid, **(headers or {})},
        content_type="application/json",
    )


def keyed(gateway: Gateway, handler: Callable[[web.Request, str], Awaitable[Any]]) -> Handler:
    """``handler`` (given the request and its ID) behind the key check; what it returns is the
    answer when it is one, else a document answered as JSON."""

    async def run(request: web.Request) -> web.StreamResponse:
        rid = new_ulid()
        try:
            if not gateway.admits(request.headers):
                raise UnauthorizedError()
            result = await handler(request, rid)
        except GatewayError as err:
            return error_response(err, {REQUEST_ID: rid})
        return result if isinstance(result, web.StreamResponse) else json_answer(result, rid)

    return run
