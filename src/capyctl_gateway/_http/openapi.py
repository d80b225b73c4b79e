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

from .._errors import GatewayError
from .._gateway import Gateway
from .._ulid import REQUEST_ID, new_ulid
from .answers import error_response
from .calls import identify

__all__ = ["OPENAPI_DOCUMENT", "openapi_handler"]

OPENAPI_DOCUMENT: bytes = orjson.dumps(
    orjson.loads(files("capyctl_gateway").joinpath("openapi.json").read_bytes())
)
"""The document as served: the packaged file, parsed and written compactly."""


def openapi_handler(
    gateway: Gateway,
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The handler of ``GET /openapi.json``. The key and ``X-Request-Id`` are judged as on
    every other route (`identify`): the key first, a caller's ID handed back when valid."""

    async def openapi(request: web.Request) -> web.Response:
        headers = {REQUEST_ID: new_ulid()}
        try:
            identify(gateway, request, headers)
        except GatewayError as err:
            return error_response(err, headers)
        return web.Response(body=OPENAPI_DOCUMENT, headers=headers, content_type="application/json")

    return openapi
