"""A request on the public listener before and on its way to an engine: who sent it (the key,
the caller's ``X-Request-Id``), the admitted `Call`, and the answers of paths that serve
nothing (404, 405)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from .._config import Api, Deployment
from .._deployments.routes import Facts
from .._errors import GatewayError, UnauthorizedError
from .._gateway import Gateway
from .._tally import Tally
from .._ulid import REQUEST_ID, new_ulid
from .answers import error_response
from .validate import caller_request_id

__all__ = ["Call", "identify", "not_found", "wrong_method"]


class Call:
    """One admitted request on its way to an instance."""

    __slots__ = (
        "api",
        "caller",
        "dep",
        "facts",
        "headers",
        "notes",
        "payload",
        "request",
        "rid",
        "stream",
        "tally",
    )

    def __init__(
        self,
        *,
        request: web.Request,
        api: Api,
        dep: Deployment,
        payload: bytes,
        stream: bool,
        headers: dict[str, str],
        rid: str,
        caller: str | None,
        tally: Tally,
        facts: Facts,
        notes: Any = None,
    ) -> None:
        self.request, self.api, self.dep, self.payload = request, api, dep, payload
        self.stream, self.headers, self.rid, self.caller = stream, headers, rid, caller
        self.tally = tally
        """Its counts: the last exchange offered (the one that answered, or failed) too."""
        self.facts = facts
        """What the chooser may weigh of it (`place`)."""
        self.notes = notes
        """What its surface's run needs beyond the payload (the Responses API's echo)."""


def identify(
    gateway: Gateway, request: web.Request, headers: dict[str, str], *, bare: str | None = None
) -> str | None:
    """Check the key (``bare``: a header that may carry it instead of ``Authorization``) and
    the caller's ``X-Request-Id``; the latter is handed back on every answer that follows, a
    401 included. Returns the caller's ID."""
    problem: GatewayError | None = None
    caller = None
    try:
        caller = caller_request_id(request.headers.getall("X-Request-Id", []))
    except GatewayError as err:
        problem = err
    if caller is not None:
        headers["X-Request-Id"] = caller
    if not gateway.admits(request.headers, bare=bare):
        raise UnauthorizedError()  # none, a wrong one, or several (never the first that fits)
    if problem is not None:
        raise problem
    return caller


async def not_found(request: web.Request) -> web.Response:
    err = GatewayError(f"no route {request.method} {request.path}", status=404, code="not_found")
    return error_response(err, _ids(request))


def wrong_method(
    allow: str, shape: Callable[[GatewayError, dict[str, str]], web.Response] = error_response
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The 405 handler of a path that answers ``allow`` only (in its API's error ``shape``)."""

    async def refuse(request: web.Request) -> web.Response:
        err = GatewayError(
            f"{request.path} answers {allow}, not {request.method}",
            status=405,
            code="method_not_allowed",
        )
        return shape(err, {**_ids(request), "Allow": allow})

    return refuse


def _ids(request: web.Request) -> dict[str, str]:
    """Our request ID, and the caller's when it sent a valid one (as on every answer)."""
    headers = {REQUEST_ID: new_ulid()}
    try:
        caller = caller_request_id(request.headers.getall("X-Request-Id", []))
    except GatewayError:
        caller = None
    if caller is not None:
        headers["X-Request-Id"] = caller
    return headers
