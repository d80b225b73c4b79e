"""The public listener's handlers: ``/v1/models``, chat and decisions.

A chat or decision request goes: request ID, key, caller's ID, body (bounded), checks, the
engine's payload, the deployment's queue, then offers to its instances. An offer that the
engine provably never got (`NotAcceptedError`) goes to the next instance, up to `MAX_OFFERS`; any
other outcome is the answer. After each offer the request is charged to its instance until
settled if it may still run there.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from .._config import REMOTE_MAX_BODY_BYTES, Api, Deployment
from .._errors import (
    EngineError,
    GatewayError,
    NotAcceptedError,
    TooLargeError,
    UnauthorizedError,
    UnavailableError,
)
from .._gateway import Gateway
from .._log import event
from .._loop import running_loop
from .._relay.chat import collect_chat, relay_chat
from .._relay.decisions import relay_decision
from .._relay.exchange import Exchange, Outcome
from .._routing import candidates, skipped
from .._ulid import new_ulid
from .answers import answer, error_response
from .body import Body
from .record import Times, outcome_of, record
from .validate import caller_request_id, check_chat, check_decision, engine_payload, resolve

__all__ = ["MAX_OFFERS", "Inference", "identify", "not_found", "wrong_method"]

logger = logging.getLogger("capyctl_gateway")
MAX_OFFERS = 4
"""Instances a request is offered to, when the ones before provably never got it."""


class Inference:
    """The handlers of the public listener, over one `Gateway`."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        # The routes' handlers are `_serve` itself (a coroutine frame less on every resume).
        self.chat = functools.partial(self._serve, api=Api.CHAT)
        self.decide = functools.partial(self._serve, api=Api.DECISIONS)

    async def models(self, request: web.Request) -> web.Response:
        headers = {"X-CapyCTL-Request-Id": new_ulid()}
        try:
            identify(self.gw, request, headers)
        except GatewayError as err:
            return error_response(err, headers)
        return web.Response(
            body=self.gw.models_document, headers=headers, content_type="application/json"
        )

    async def _serve(self, request: web.Request, api: Api) -> web.StreamResponse:
        loop = running_loop()
        times = Times(loop.time())
        rid = new_ulid()
        headers = {"X-CapyCTL-Request-Id": rid}
        config = self.gw.config
        limits = config.limits
        held = Body(self.gw.bodies)
        deadline = times.arrival + config.queue.request_deadline
        name, outcome, code = "", "hang_up", None  # what a cancellation leaves
        call: _Call | None = None
        try:
            try:
                caller = identify(self.gw, request, headers)
                chat_api = api is Api.CHAT
                limit = limits.max_body_bytes if chat_api else limits.max_decision_body_bytes
                raw = await held.read(request, limit, limits.body_read_timeout)
                body, dep = resolve(raw, config, api)
                name = dep.name  # known from here on: the refusals below count under it
                if chat_api:
                    stream = check_chat(body, dep).stream
                else:
                    check_decision(body, dep)
                    stream = False
                payload = engine_payload(body, dep, chat=api is Api.CHAT, stream=stream)
                if dep.remote and len(payload) > REMOTE_MAX_BODY_BYTES:
                    raise TooLargeError(
                        f"deployment {name} runs on another machine: its requests must fit in "
                        f"{REMOTE_MAX_BODY_BYTES} bytes"
                    )
                del raw, body
                route = self.gw.routes[dep.name]
                await route.queue.acquire(deadline)
                times.slot = loop.time()
                if dep.launched:
                    try:
                        await self.gw.lifecycle.ensure_ready(dep.name, deadline)
                    except BaseException:
                        route.queue.release()
                        raise
                    times.ready = loop.time()
            except GatewayError as err:
                outcome, code = "refused", err.code
                return await answer(request, err, headers, rid)
            try:
                call = _Call(
                    request, api, dep, payload, stream, headers, rid, caller, times.arrival
                )
                response = await self._offer(call)
                outcome = outcome_of(call.ex, None)
                return response
            except GatewayError as err:
                outcome, code = outcome_of(call.ex if call else None, err), err.code
                return await answer(request, err, headers, rid)
            finally:
                route.queue.release()
        finally:
            held.release()
            ex = call.ex if call is not None else None
            instance = call.instance if call is not None else None
            launched = call is not None and call.dep.launched
            record(self.gw.telemetry, name, api.value, outcome, code, times, ex, instance, launched)

    async def _offer(self, call: _Call) -> web.StreamResponse:
        route = self.gw.routes[call.dep.name]
        if all(i.unusable for i in route.instances):
            raise UnavailableError(
                f"deployment {call.dep.name}: its instances failed their startup checks "
                "(see the gateway's log or `capyctl-gateway status deployment`)",
                detail="; ".join(f"{i.where}: {i.unusable}" for i in route.instances),
            )
        refused: set[int] = set()
        details: list[str] = []
        loop = running_loop()
        deadline = call.arrival + self.gw.config.queue.request_deadline
        while len(refused) < MAX_OFFERS:
            instance = route.choose(self.gw.load, refused)
            if instance is None:
                if refused:
                    break
                # None may take it now (its host is gone, its engine is parking): wait for one.
                if not await route.available(deadline - loop.time()):
                    raise UnavailableError(
                        f"deployment {call.dep.name}: no instance could take the request within "
                        "queue.request_deadline",
                        detail="; ".join(skipped(self.gw, route)),
                    )
                continue
            if len(route.instances) > 1 or call.dep.remote:
                shown, skipped_ = candidates(self.gw, route, refused)
                _log_route("router_selection", call, instance.index, instance.host,
                           candidates=shown, skipped=skipped_)  # fmt: skip
            else:
                _log_route("router_selection", call, instance.index, instance.host)
            assert self.gw.engines is not None
            ex = Exchange(
                self.gw.engines,
                instance.chat_url if call.api is Api.CHAT else instance.decision_url,
                instance.headers,
                where=instance.where,
                deadline=call.arrival + self.gw.config.queue.request_deadline,
                idle_timeout=self.gw.config.queue.stream_idle_timeout,
                drains=self.gw.drains,
            )
            call.ex, call.instance = ex, instance.index
            instance.ledger.running += 1
            remote = instance.remote is not None
            if remote:
                ex.abortable()
                instance.exchanges.add(ex)
            try:
                return await self._exchange(call, ex)
            except NotAcceptedError as exc:
                # The engine never saw it: another instance may serve it, within the deadline.
                refused.add(instance.index)
                details.append(exc.detail or exc.message)
                _log_route("router_failover", call, instance.index, instance.host, exc.detail)
            finally:
                if remote:
                    instance.exchanges.discard(ex)
                instance.ledger.running -= 1
                _account(self.gw, call.rid, instance.ledger.key, ex.outcome)
        raise EngineError(
            f"deployment {call.dep.name}: its instances could not be reached",
            detail="; ".join(details) or "no instance to send it to",
        )

    async def _exchange(self, call: _Call, ex: Exchange) -> web.StreamResponse:
        cap = self.gw.config.limits.max_answer_bytes
        if call.api is Api.DECISIONS:
            body = await relay_decision(
                ex, call.payload, public=call.dep.name, arrival=call.arrival, max_bytes=cap
            )
        elif not call.stream:
            body = await collect_chat(ex, call.dep, call.payload, max_bytes=cap)
        else:
            return await relay_chat(call.request, ex, call.dep, call.payload, headers=call.headers)
        return web.Response(body=body, headers=call.headers, content_type="application/json")


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


def _account(gw: Gateway, rid: str, key: str, out: Outcome) -> None:
    """A request that may still run on the engine stays charged until it is settled."""
    if out.sent and not out.completed:
        reason = out.cut or "engine stream broken"
        ledger = gw.settlement.ledgers[key]
        gw.settlement.cut(ledger, rid, answered=out.answered, reason=reason)


def _ids(request: web.Request) -> dict[str, str]:
    """Our request ID, and the caller's when it sent a valid one (as on every answer)."""
    headers = {"X-CapyCTL-Request-Id": new_ulid()}
    try:
        caller = caller_request_id(request.headers.getall("X-Request-Id", []))
    except GatewayError:
        caller = None
    if caller is not None:
        headers["X-Request-Id"] = caller
    return headers


class _Call:
    """One admitted request on its way to an instance."""

    __slots__ = (
        "api",
        "arrival",
        "caller",
        "dep",
        "ex",
        "headers",
        "instance",
        "payload",
        "request",
        "rid",
        "stream",
    )

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
        arrival: float,
    ) -> None:
        self.request, self.api, self.dep, self.payload = request, api, dep, payload
        self.stream, self.headers, self.rid, self.caller = stream, headers, rid, caller
        self.arrival = arrival
        self.ex: Exchange | None = None
        """The last exchange offered (the one that answered, or failed)."""
        self.instance: int | None = None


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
    keys = request.headers.getall("Authorization", [])
    if len(keys) != 1 or not gateway.authorized(keys[0]):
        raise UnauthorizedError()  # none, a wrong one, or several (never the first that fits)
    if problem is not None:
        raise problem
    return caller


def _log_route(
    name: str, call: _Call, index: int, host: str, detail: str | None = None, **more: Any
) -> None:
    fields: dict[str, Any] = {
        "capyctl_request_id": call.rid,
        "deployment": call.dep.name,
        "instance": index,
        "host": host,
        **more,
    }
    if call.caller is not None:
        fields["caller_request_id"] = call.caller
    caller = f" (caller {call.caller})" if call.caller is not None else ""
    if name == "router_selection":
        event(name, "request %s%s %s -> %s instance %d", call.rid, caller, call.dep.name, host,
              index, **fields)  # fmt: skip
    else:
        event(name, "request %s%s %s: instance %d on %s did not take it (%s)", call.rid, caller,
              call.dep.name, index, host, detail, **fields, reason="not_accepted",
              detail=detail)  # fmt: skip
