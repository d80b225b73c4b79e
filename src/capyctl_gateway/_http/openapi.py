"""``GET /openapi.json``: the public listener's OpenAPI document, behind the same key.

The document ships in the package (``capyctl_gateway/openapi.json``; ``docs/openapi.json`` is
the same file, and a test holds them equal). It is read and parsed once, at import, so a broken
file stops the gateway at start rather than on the first request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.resources import files

import orjson
from aiohttp import web

from .._errors import GatewayError, UnauthorizedError
from .._ulid import REQUEST_ID, new_ulid
from .answers import error_response
from .validate import caller_request_id

__all__ = ["OPENAPI_DOCUMENT", "openapi_handler"]

OPENAPI_DOCUMENT: bytes = orjson.dumps(
    orjson.loads(files("capyctl_gateway").joinpath("openapi.json").read_bytes())
)
"""The document as served: the packaged file, parsed and written compactly."""


def openapi_handler(
    authorized: Callable[[str], bool],
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The handler of ``GET /openapi.json``; ``authorized`` tells whether an ``Authorization``
    value carries the gateway's key (`Gateway.authorized`). The key and ``X-Request-Id`` are
    judged as on every other route: the key first, a caller's ID handed back when valid."""

    async def openapi(request: web.Request) -> web.Response:
        headers = {REQUEST_ID: new_ulid()}
        problem: GatewayError | None = None
        try:
            caller = caller_request_id(request.headers.getall("X-Request-Id", []))
        except GatewayError as err:
            problem = err
        else:
            if caller is not None:
                headers["X-Request-Id"] = caller
        keys = request.headers.getall("Authorization", [])
        if len(keys) != 1 or not authorized(keys[0]):
            return error_response(UnauthorizedError(), headers)
        if problem is not None:
            return error_response(problem, headers)
        return web.Response(body=OPENAPI_DOCUMENT, headers=headers, content_type="application/json")

    return openapi
