"""The management API, served on the loopback management listener with the gateway's key."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from .._errors import GatewayError, UnknownModelError
from .._gateway import Gateway
from .._http.answers import error_response
from .._lifecycle.operator import (
    deployments_list,
    operator_park,
    operator_start,
    operator_stop,
)
from .._ulid import REQUEST_ID, new_ulid
from .console import add_console_routes, annotate
from .keyed import Handler, keyed
from .live import add_live_routes
from .metrics import exposition
from .status import deployment_status, instance_hosts
from .tickets import Tickets, add_ticket_routes

__all__ = ["create_management_app", "create_metrics_app"]


async def not_found(request: web.Request) -> web.Response:
    err = GatewayError(f"no route {request.method} {request.path}", status=404, code="not_found")
    return error_response(err, {REQUEST_ID: new_ulid()})


def create_management_app(gateway: Gateway) -> web.Application:
    """The management application over ``gateway``: status, operator commands, ``/metrics``,
    and the console (its page, event stream, engine logs and recent figures)."""

    async def deployment(request: web.Request, rid: str) -> dict[str, Any]:
        name = request.match_info["name"]
        doc = deployment_status(gateway.fleet, name)
        if doc is None:
            raise UnknownModelError(f"no deployment named {name!r}")
        return annotate(gateway.fleet, doc)

    async def listing(request: web.Request, rid: str) -> dict[str, Any]:
        budget = gateway.config.resources.memory_budget
        fleet = gateway.fleet
        doc = deployments_list(fleet.lifecycle, fleet.routes, budget)
        for row in doc["deployments"]:
            hosts = instance_hosts(fleet, row["name"])
            if hosts:
                row["hosts"] = hosts
                row["run_by"] = "hosts " + ", ".join(sorted({h["host"] for h in hosts}))
        return doc

    async def act(request: web.Request, rid: str) -> dict[str, Any] | None:
        name, action = request.match_info["name"], request.match_info["action"]
        fleet = gateway.fleet
        command = {"start": operator_start, "stop": operator_stop, "park": operator_park}
        await command[action](fleet.lifecycle, name, known=name in fleet.routes)
        doc = deployment_status(fleet, name)
        return annotate(fleet, doc) if doc is not None else doc

    app = web.Application()
    app.router.add_get("/metrics", _metrics_handler(gateway))
    app.router.add_get("/management/v1/deployments", keyed(gateway, listing))
    app.router.add_get("/management/v1/deployments/{name}", keyed(gateway, deployment))
    app.router.add_post(
        "/management/v1/deployments/{name}/{action:start|stop|park}", keyed(gateway, act)
    )
    add_live_routes(app, gateway)
    add_console_routes(app)
    add_ticket_routes(app, gateway, Tickets())
    app.router.add_route("*", "/{tail:[\\s\\S]*}", not_found)
    return app


def _metrics_handler(gateway: Gateway) -> Handler:
    async def metrics(request: web.Request, rid: str) -> web.Response:
        return web.Response(
            body=exposition(gateway),
            headers={REQUEST_ID: rid},
            content_type="text/plain",
            charset="utf-8",
        )

    return keyed(gateway, metrics)


def create_metrics_app(gateway: Gateway) -> web.Application:
    """``GET /metrics`` alone (same key), for a listener a Prometheus scraper can reach."""
    app = web.Application()
    app.router.add_get("/metrics", _metrics_handler(gateway))
    app.router.add_route("*", "/{tail:[\\s\\S]*}", not_found)
    return app
