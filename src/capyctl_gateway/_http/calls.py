"""A request on the public listener before and on its way to an engine: who sent it (the key,
the caller's ``X-Request-Id``), the admitted `Call`, the router's log lines, and the answers of
paths that serve nothing (404, 405)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from .._config import Api, Deployment
from .._deployments.routes import EngineInstance, Route
from .._errors import GatewayError, UnauthorizedError
from .._gateway import Gateway
from .._log import event
from .._ulid import REQUEST_ID, new_ulid
from .answers import error_response
from .record import Tally
from .validate import caller_request_id

__all__ = ["Asked", "Call", "identify", "log_route", "not_found", "wrong_method"]


class Asked(Protocol):
    """What placing a request and its router lines know of it: its ID, its caller's and its
    deployment (a `Call` here; the authority's record of a worker's request there)."""

    @property
    def rid(self) -> str: ...

    @property
    def caller(self) -> str | None: ...

    @property
    def dep(self) -> Deployment: ...


class Call:
    """One admitted request on its way to an instance."""

    __slots__ = ("api", "caller", "dep", "headers", "payload", "request", "rid", "stream", "tally")

    def __init__(
        self,
        request: web.Request,
        api: Api,
        dep: Deployment,
        payload: bytes,
        stream: bool,
        headers: dict[str, str],
        rid: str,
        caller: str | None,
        tally: Tally,
    ) -> None:
        self.request, self.api, self.dep, self.payload = request, api, dep, payload
        self.stream, self.headers, self.rid, self.caller = stream, headers, rid, caller
        self.tally = tally
        """Its counts: the last exchange offered (the one that answered, or failed) too."""


def identify(gateway: Gateway, request: web.Request, headers: dict[str, str]) -> str | None:
    """Check the key and the caller's ``X-Request-Id``; the latter is handed back on every
    answer that follows, a 401 included. Returns the caller's ID."""
    problem: GatewayError | None = None
    caller = None
    try:
        caller = caller_request_id(request.headers.getall("X-Request-Id", []))
    except GatewayError as err:
        problem = err
    if caller is not None:
        headers["X-Request-Id"] = caller
    if not gateway.admits(request.headers):
        raise UnauthorizedError()  # none, a wrong one, or several (never the first that fits)
    if problem is not None:
        raise problem
    return caller


async def not_found(request: web.Request) -> web.Response:
    err = GatewayError(f"no route {request.method} {request.path}", status=404, code="not_found")
    return error_response(err, _ids(request))


def wrong_method(allow: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The 405 handler of a path that answers ``allow`` only."""

    async def refuse(request: web.Request) -> web.Response:
        err = GatewayError(
            f"{request.path} answers {allow}, not {request.method}",
            status=405,
            code="method_not_allowed",
        )
        return error_response(err, {**_ids(request), "Allow": allow})

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


def log_route(
    name: str,
    call: Asked,
    route: Route,
    instance: EngineInstance,
    detail: str | None = None,
    **more: Any,
) -> None:
    """A router line: ``request <ID> (caller <theirs>) <deployment ID> -> <machine> instance
    <N>`` for a selection, or why an instance did not take the request for a failover."""
    fields: dict[str, Any] = {
        "capyctl_request_id": call.rid,
        "deployment": call.dep.name,
        "deployment_id": route.id,
        "instance": instance.index,
        "host": instance.host,
        "machine": instance.machine,
        **more,
    }
    if call.caller is not None:
        fields["caller_request_id"] = call.caller
    caller = f" (caller {call.caller})" if call.caller is not None else ""
    if name == "router_selection":
        event(
            name,
            "request %s%s %s -> %s instance %d",
            call.rid,
            caller,
            route.id,
            instance.machine,
            instance.index,
            **fields,
        )
    else:
        event(
            name,
            "request %s%s %s: instance %d on %s did not take it (%s)",
            call.rid,
            caller,
            route.id,
            instance.index,
            instance.machine,
            detail,
            **fields,
            reason="not_accepted",
            detail=detail,
        )
