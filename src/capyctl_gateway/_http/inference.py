"""The public listener's handlers: ``/v1/models`` (and one model), chat and decisions.

Each API is one `Surface`, bound once: its body limit, its checks, the engine path it is
posted to and how its answer is run. A chat or decision request goes: request ID, key,
caller's ID, body (bounded), the surface's checks, the engine's payload; then its `Desk`
places it (a running slot of the deployment's queue, offers to its instances: ``offer.py``)
and runs it, and takes its counts once it is answered.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from aiohttp import web
from yarl import URL

from .._clock import stamp
from .._config import REMOTE_MAX_BODY_BYTES, Api, Deployment, GatewayConfig
from .._deployments.routes import EngineInstance, Facts
from .._errors import GatewayError, TooLargeError, UnknownModelError
from .._gateway import Gateway
from .._machines.protocol import INGRESS_MAX_BODY_BYTES
from .._relay.chat import collect_chat, relay_chat
from .._relay.decisions import relay_decision
from .._relay.exchange import Exchange
from .._routing.place import MAX_OFFERS
from .._routing.prefix import BLOCK_BYTES, fingerprints
from .._tally import Tally
from .._ulid import REQUEST_ID, new_ulid
from .answers import answer, error_response
from .body import Body
from .calls import Call, identify
from .offer import Desk, LocalDesk
from .validate import check_chat, check_decision, engine_payload, resolve

__all__ = ["CHAT", "DECISIONS", "MAX_OFFERS", "Inference", "Surface"]

logger = logging.getLogger("capyctl_gateway")


@dataclass(frozen=True, slots=True)
class Surface:
    """One API of the public listener, decided once per request: by its route."""

    api: Api
    max_body: Callable[[GatewayConfig], int]
    check: Callable[[dict[str, Any], Deployment], bool]
    """The API's checks of a request for a deployment; whether the engine is asked to stream."""
    url: Callable[[EngineInstance], URL]
    run: Callable[[Call, Exchange, int], Awaitable[web.StreamResponse]]
    """The exchange, once an instance is chosen (``int``: the bound on an assembled answer)."""


async def _chat(call: Call, ex: Exchange, cap: int) -> web.StreamResponse:
    if call.stream:
        return await relay_chat(call.request, ex, call.dep, call.payload, headers=call.headers)
    body = await collect_chat(ex, call.dep, call.payload, max_bytes=cap)
    return web.Response(body=body, headers=call.headers, content_type="application/json")


async def _decide(call: Call, ex: Exchange, cap: int) -> web.StreamResponse:
    arrival = call.tally.arrival
    body = await relay_decision(
        ex, call.payload, public=call.dep.name, arrival=arrival, max_bytes=cap
    )
    return web.Response(body=body, headers=call.headers, content_type="application/json")


def _check_decision(body: dict[str, Any], dep: Deployment) -> bool:
    check_decision(body, dep)
    return False  # a decision is answered whole


CHAT = Surface(
    Api.CHAT,
    attrgetter("limits.max_body_bytes"),
    lambda body, dep: check_chat(body, dep).stream,
    attrgetter("chat_url"),
    _chat,
)
DECISIONS = Surface(
    Api.DECISIONS,
    attrgetter("limits.max_decision_body_bytes"),
    _check_decision,
    attrgetter("decision_url"),
    _decide,
)


def _listed(gateway: Gateway, name: str | None) -> bytes:
    """The models list, or (``name``) that deployment's entry of it."""
    if name is None:
        return gateway.models_document
    document = gateway.model_documents.get(name)
    if document is None:
        raise UnknownModelError(f"no deployment serves model {name!r}")
    return document


class Inference:
    """The handlers of the public listener, over one `Gateway`."""

    def __init__(self, gateway: Gateway, desk: Desk | None = None) -> None:
        self.gw = gateway
        self.desk: Desk = LocalDesk(gateway) if desk is None else desk
        """Where a checked request is placed and run: this process's fleet by default."""
        # The routes' handlers are `_serve` itself (a coroutine frame less on every resume).
        self.chat = functools.partial(self._serve, surface=CHAT)
        self.decide = functools.partial(self._serve, surface=DECISIONS)

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``, and ``GET /v1/models/{model}``: that entry of the list. Neither
        asks an engine anything or wakes a model."""
        headers = {REQUEST_ID: new_ulid()}
        try:
            identify(self.gw, request, headers)
            document = _listed(self.gw, request.match_info.get("model"))
        except GatewayError as err:
            return error_response(err, headers)
        return web.Response(body=document, headers=headers, content_type="application/json")

    async def _serve(self, request: web.Request, surface: Surface) -> web.StreamResponse:
        tally = Tally(surface.api.value, stamp())
        rid = new_ulid()
        headers = {REQUEST_ID: rid}
        config = self.gw.config
        held = Body(self.gw.bodies)
        try:
            caller = identify(self.gw, request, headers)
            raw = await held.read(
                request, surface.max_body(config), config.limits.body_read_timeout
            )
            body, dep = resolve(raw, config, surface.api)
            tally.deployment = name = dep.name  # the refusals below count under it
            stream = surface.check(body, dep)
            payload = engine_payload(body, dep, chat=surface.api is Api.CHAT, stream=stream)
            if dep.remote:
                _fits_a_host(name, len(raw), len(payload))
            facts = self._facts(body, dep, surface.api, len(raw))
            del raw, body
            deadline = tally.arrival + config.queue.request_deadline
            call = Call(
                request=request,
                api=surface.api,
                dep=dep,
                payload=payload,
                stream=stream,
                headers=headers,
                rid=rid,
                caller=caller,
                tally=tally,
                facts=facts,
            )
            response = await self.desk.serve(call, surface, deadline)
            tally.ended()
            return response
        except GatewayError as err:
            tally.ended(err)
            return await answer(request, err, headers, rid)
        finally:
            held.release()
            self.desk.record(tally)

    def _facts(self, body: dict[str, Any], dep: Deployment, api: Api, sent: int) -> Facts:
        """What routing weighs of the request: its salt, and the fingerprints of its prefix
        where its deployment chooses among several instances by prefix (none for a body of
        ``sent`` bytes under one block: its prompt's canonical JSON is never longer)."""
        salt = body.get("cache_salt")  # checked already: a string, or absent
        salt = salt if isinstance(salt, str) else None
        if dep.routing.policy != "prefix" or len(dep.instances) < 2 or sent < BLOCK_BYTES:
            return Facts(dep.name, salt)
        chain = fingerprints(body, chat=api is Api.CHAT, salt=salt, seed=self.gw.prefix_seed)
        return Facts(dep.name, salt, chain)


def _fits_a_host(name: str, sent: int, payload: int) -> None:
    """Refuse (413) a request for a deployment on another machine that its host's ingress
    would not take: the body the client sent over 8 MiB, or the engine's copy of it (the
    model renamed, a stream asked for, numbers written out) past the ingress's limit."""
    if sent > REMOTE_MAX_BODY_BYTES:
        raise TooLargeError(
            f"deployment {name} runs on another machine: its requests must fit in "
            f"{REMOTE_MAX_BODY_BYTES} bytes"
        )
    if payload > INGRESS_MAX_BODY_BYTES:
        raise TooLargeError(
            f"deployment {name} runs on another machine: the request as the engine would get "
            f"it is {payload} bytes, over the {INGRESS_MAX_BODY_BYTES} its host takes (the "
            "gateway writes numbers such as 1e5 out in full: 100000.0)"
        )
