"""The management API, served on the loopback management listener with the gateway's key."""

from __future__ import annotations

import orjson
from aiohttp import web

from .._errors import GatewayError, UnauthorizedError, UnknownModelError
from .._gateway import Gateway
from .._http.answers import error_response
from .._ulid import new_ulid
from .status import deployment_status

__all__ = ["create_management_app"]


def _error(err: GatewayError, rid: str) -> web.Response:
    return error_response(err, {"X-CapyCTL-Request-Id": rid})


def create_management_app(gateway: Gateway) -> web.Application:
    """The management application over ``gateway``."""

    async def deployment(request: web.Request) -> web.Response:
        rid = new_ulid()
        if not gateway.authorized(request.headers.get("Authorization", "")):
            return _error(UnauthorizedError(), rid)
        name = request.match_info["name"]
        doc = deployment_status(gateway, name)
        if doc is None:
            return _error(UnknownModelError(f"no deployment named {name!r}"), rid)
        return web.Response(
            body=orjson.dumps(doc),
            headers={"X-CapyCTL-Request-Id": rid},
            content_type="application/json",
        )

    async def not_found(request: web.Request) -> web.Response:
        err = GatewayError(
            f"no route {request.method} {request.path}", status=404, code="not_found"
        )
        return _error(err, new_ulid())

    app = web.Application()
    app.router.add_get("/management/v1/deployments/{name}", deployment)
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app
