"""The public listener's handlers: ``/v1/models`` (and one model), chat, responses and
decisions (Anthropic's Messages API is bound as two more surfaces in ``messages.py``).

Each API is one `Surface`, bound once: its body limit, its checks, the engine path it is
posted to and how its answer is run. Responses are served by chat deployments: their checks
turn the request into the engine's chat request (``_responses/``). A request goes: request ID, key,
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
from multidict import CIMultiDictProxy
from yarl import URL

from .. import _clock
from .._config import Api, Deployment, GatewayConfig
from .._deployments.routes import EngineInstance, Facts
from .._errors import GatewayError, UnknownModelError
from .._gateway import Gateway
from .._relay.chat import collect_chat, relay_chat
from .._relay.decisions import relay_decision
from .._relay.exchange import Exchange
from .._responses.relay import collect_response, refuse_response, relay_response
from .._responses.request import check_responses
from .._routing.place import MAX_OFFERS
from .._routing.prefix import BLOCK_BYTES, fingerprints
from .._tally import Tally
from .._ulid import REQUEST_ID, new_ulid
from .answers import InBand, answer, chat_in_band, error_response
from .body import Body, client_of
from .calls import Call, identify
from .offer import Desk, LocalDesk
from .validate import (
    ENDPOINTS,
    check_chat,
    check_decision,
    check_salt,
    engine_payload,
    fits_a_host,
    resolve,
    take_priority,
)

__all__ = ["CHAT", "DECISIONS", "MAX_OFFERS", "RESPONSES", "Checked", "Inference", "Surface"]

logger = logging.getLogger("capyctl_gateway")


@dataclass(frozen=True, slots=True)
class Surface:
    """One API of the public listener, decided once per request: by its route."""

    name: str
    """What its requests count under (the ``api`` label of their series and events)."""
    endpoint: str
    api: Api
    """The API of the deployments it serves."""
    max_body: Callable[[GatewayConfig], int]
    check: Callable[[dict[str, Any], Deployment], Checked]
    url: Callable[[EngineInstance], URL]
    run: Callable[[Call, Exchange, int], Awaitable[web.StreamResponse]]
    """The exchange, once an instance is chosen (``int``: the bound on an assembled answer)."""
    in_band: Callable[[Deployment, Any], InBand]
    """How a refusal is told on the stream the client asked for, given its deployment and
    what the checks noted (the ``notes`` of `Checked`): each API in its own form."""
    shape: Callable[[GatewayError, dict[str, str]], web.Response] = error_response
    """How a refusal is answered over HTTP: the gateway's JSON, or the API's own (Anthropic's)."""
    key_header: str | None = None
    """A header that may carry the key itself, beside ``Authorization`` (``x-api-key``)."""
    admit: Callable[[CIMultiDictProxy[str]], None] | None = None
    """The API's own header checks, after the key's (Anthropic's version and betas)."""


Checked = tuple[dict[str, Any], bool, Any]
"""A request through its API's checks: the body for the engine (its model and stream fields
still to be written), whether the client asked for a stream, and what the surface's `run`
needs of it beyond the payload (the Responses API's echo; None where nothing). A plain
tuple: a NamedTuple's construction, once a request, costs about 2,500 instructions more."""


async def _chat(call: Call, ex: Exchange, cap: int) -> web.StreamResponse:
    if call.stream:
        return await relay_chat(call.request, ex, call.dep, call.payload, headers=call.headers)
    body = await collect_chat(ex, call.dep, call.payload, max_bytes=cap)
    return web.Response(body=body, headers=call.headers, content_type="application/json")


async def _decide(call: Call, ex: Exchange, cap: int) -> web.StreamResponse:
    arrival = call.tally.arrival
    hide = call.dep.cached_tokens == "withheld"
    body = await relay_decision(
        ex, call.payload, public=call.dep.name, arrival=arrival, max_bytes=cap, hide=hide
    )
    return web.Response(body=body, headers=call.headers, content_type="application/json")


async def _respond(call: Call, ex: Exchange, cap: int) -> web.StreamResponse:
    if call.stream:
        return await relay_response(
            call.request, ex, call.dep, call.payload, headers=call.headers, echo=call.notes, cap=cap
        )
    body = await collect_response(ex, call.dep, call.payload, echo=call.notes, cap=cap)
    return web.Response(body=body, headers=call.headers, content_type="application/json")


def _check_chat(body: dict[str, Any], dep: Deployment) -> Checked:
    return body, check_chat(body, dep), None


def _check_decision(body: dict[str, Any], dep: Deployment) -> Checked:
    check_decision(body, dep)
    return body, False, None  # a decision is answered whole


def _check_responses(body: dict[str, Any], dep: Deployment) -> Checked:
    return check_responses(body)


def _chat_in_band(dep: Deployment, notes: Any) -> InBand:
    return chat_in_band  # a decision is never streamed: nothing of it is told in band


def _responses_in_band(dep: Deployment, echo: Any) -> InBand:
    return functools.partial(refuse_response, dep=dep, echo=echo)


CHAT = Surface(
    "chat",
    ENDPOINTS[Api.CHAT],
    Api.CHAT,
    attrgetter("limits.max_body_bytes"),
    _check_chat,
    attrgetter("chat_url"),
    _chat,
    _chat_in_band,
)
RESPONSES = Surface(
    "responses",
    "/v1/responses",
    Api.CHAT,
    attrgetter("limits.max_body_bytes"),
    _check_responses,
    attrgetter("chat_url"),
    _respond,
    _responses_in_band,
)
DECISIONS = Surface(
    "decisions",
    ENDPOINTS[Api.DECISIONS],
    Api.DECISIONS,
    attrgetter("limits.max_decision_body_bytes"),
    _check_decision,
    attrgetter("decision_url"),
    _decide,
    _chat_in_band,
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
        self.respond = functools.partial(self._serve, surface=RESPONSES)
        self.decide = functools.partial(self._serve, surface=DECISIONS)

    def serves(self, surface: Surface) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """The handler of ``surface``'s route (the Messages API's: ``messages.py``)."""
        return functools.partial(self._serve, surface=surface)

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

    async def stored(self, request: web.Request) -> web.Response:
        """``/v1/responses/{id}`` and below it (cancel, input items), any method: the gateway
        keeps no responses, so there is none to get, cancel or delete (404, after the key)."""
        headers = {REQUEST_ID: new_ulid()}
        try:
            identify(self.gw, request, headers)
            raise GatewayError(
                "the gateway keeps no responses: each is answered once, to its request",
                status=404,
                code="not_found",
            )
        except GatewayError as err:
            return error_response(err, headers)

    async def _serve(self, request: web.Request, surface: Surface) -> web.StreamResponse:
        tally = Tally(surface.name, _clock.now())
        rid = new_ulid()
        headers = {REQUEST_ID: rid}
        config = self.gw.config
        held = Body(self.gw.bodies, client_of(request.remote))
        in_band: InBand = chat_in_band
        try:
            caller = identify(self.gw, request, headers, bare=surface.key_header)
            if surface.admit is not None:
                surface.admit(request.headers)
            raw = await held.read(
                request, surface.max_body(config), config.limits.body_read_timeout
            )
            body, dep = resolve(raw, config, surface.api, surface.endpoint)
            tally.deployment = name = dep.name  # the refusals below count under it
            body, stream, notes = surface.check(body, dep)
            in_band = surface.in_band(dep, notes)
            check_salt(body, dep, in_band=stream)  # every API's, told in band on a stream
            rank = take_priority(body, dep) if "priority" in body and surface.api is Api.CHAT else 0
            payload = engine_payload(body, dep, chat=surface.api is Api.CHAT, stream=stream)
            if dep.remote:
                fits_a_host(name, len(raw), len(payload))
            facts = self._facts(body, dep, surface.api, len(raw), rank)
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
                notes=notes,
            )
            response = await self.desk.serve(call, surface, deadline)
            tally.ended()
            return response
        except GatewayError as err:
            tally.ended(err)
            return await answer(request, err, headers, rid, in_band, surface.shape)
        finally:
            held.release()
            self.desk.record(tally)

    def _facts(
        self, body: dict[str, Any], dep: Deployment, api: Api, sent: int, rank: int
    ) -> Facts:
        """What routing weighs of the request: its salt, and the fingerprints of its prefix
        where its deployment chooses among several instances by prefix (none for a body of
        ``sent`` bytes under one block: its prompt's canonical JSON is never longer)."""
        salt = body.get("cache_salt")  # checked already: a string, or absent
        salt = salt if isinstance(salt, str) else None
        if dep.routing.policy != "prefix" or len(dep.instances) < 2 or sent < BLOCK_BYTES:
            if salt is None and not rank:
                return _plain_facts(dep.name)
            return Facts(dep.name, salt, priority=rank)
        seed = self.gw.prefix_seed
        chain = fingerprints(body, chat=api is Api.CHAT, salt=salt, seed=seed, sent=sent)
        return Facts(dep.name, salt, chain, rank)


_plain_facts = functools.lru_cache(maxsize=256)(Facts)
"""The facts of a request with neither salt nor prefix, one (frozen) object per deployment: a
frozen dataclass's construction costs about 5,000 instructions, once a request."""
