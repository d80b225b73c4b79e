"""A worker's desk: the public handlers place each request through the authority and relay it
here. One ``ADMIT`` per request; the authority answers with an offer (an instance, its URL and
headers) or a refusal. The worker runs the exchange with its own engine client and says how it
ended (``END``); an engine that provably never got it asks for the next instance (``NEXT``); a
client gone before its offer came says so (``GONE``). An ``ABORT`` ends a running exchange as
one process's abort does. Each request's counts go to the authority (``COUNTS``), which keeps
the gateway's one telemetry.
"""

from __future__ import annotations

import asyncio
import itertools
from functools import partial
from typing import TYPE_CHECKING

from aiohttp import web
from yarl import URL

from .._config import GatewayConfig
from .._engine_client import EngineClient
from .._errors import (
    EngineError,
    GatewayError,
    NotAcceptedError,
    UnavailableError,
)
from .._http.calls import Call
from .._loop import running_loop
from .._relay.ending import ended_by_gateway
from .._relay.exchange import Exchange
from .._tally import Tally
from .messages import FROZEN_S, Admit, Answered, Counts, End, Gone, Next, Offer, Refused
from .wire import Wire

if TYPE_CHECKING:
    from .._http.inference import Surface

__all__ = ["MAX_URLS", "RemoteDesk"]

MAX_URLS = 256
"""Parsed engine URLs a worker keeps: a few per instance; past it the cache starts over."""
WORD_GRACE_S = 0.5
"""How long past a request's deadline a worker waits for its authority's word on it before it
answers 503 itself (the authority's own refusal at the deadline says more)."""


class RemoteDesk:
    """The worker's side of the line (`Wire`): its requests' offers and exchanges."""

    def __init__(self, config: GatewayConfig, engines: EngineClient, wire: Wire) -> None:
        self.config = config
        self.engines = engines
        self.drains: set[asyncio.Task[None]] = set()
        self.wire = wire
        self._asking: dict[int, asyncio.Future[Offer | Refused]] = {}
        self._live: dict[int, Exchange | None] = {}
        """Every request asked about and not ended, with its exchange once it has one."""
        self._aborts: dict[int, tuple[str, str]] = {}
        """Aborts that came for a live request before its exchange was made."""
        self._gid = itertools.count()
        self._urls: dict[str, URL] = {}
        """The engine URLs offers named, parsed once (at most `MAX_URLS`)."""
        self.heard_at: float | None = None
        """When the authority last pinged (None: it never did, as in a test's workers)."""

    def answer(self, m: Offer | Refused) -> None:
        """An ``OFFER`` or ``REFUSED`` for one of this worker's requests."""
        # An abort kept for an earlier offer of this request was for that instance, not this.
        self._aborts.pop(m.gid, None)
        waiting = self._asking.pop(m.gid, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(m)

    def abort(self, gid: int, why: str, code: str) -> None:
        if gid not in self._live:
            return  # it ended already
        ex = self._live[gid]
        if ex is None:
            self._aborts[gid] = (why, code)  # its offer is on its way: abort it on arrival
        else:
            ex.abort(why, code)

    def lost(self) -> None:
        """The line ended: requests waiting for an offer are refused, running ones ended."""
        gone = UnavailableError("the gateway is stopping", code="shutting_down")
        for waiting in self._asking.values():
            if not waiting.done():
                waiting.set_exception(gone)
        self._asking.clear()
        for ex in self._live.values():
            if ex is not None:
                ex.abort("the gateway is stopping (its authority ended)", "shutting_down")

    async def serve(self, call: Call, surface: Surface, deadline: float) -> web.StreamResponse:
        loop = running_loop()
        gid = next(self._gid)
        wire, tally = self.wire, call.tally
        if wire.closed:
            raise UnavailableError("the gateway is stopping", code="shutting_down")
        asked_at = loop.time()
        if self.heard_at is not None and asked_at - self.heard_at > FROZEN_S:
            raise UnavailableError(  # shed at once: nothing here can place it
                f"the gateway's authority has not answered for over {FROZEN_S:g} s"
            )
        left = deadline - loop.time()
        dep, api, facts = call.dep.name, call.api.value, call.facts
        wire.send(
            Admit(
                gid, dep, api, call.rid, call.caller, left, facts.salt, facts.prefix, facts.priority
            )
        )
        ex: Exchange | None = None
        asking = True
        self._live[gid] = None
        try:
            while True:
                asked = self._asking[gid] = loop.create_future()
                m = await _by(asked, deadline)
                asking = False
                _slot(tally, call, asked_at, m.waited, m.gated)
                if isinstance(m, Refused):
                    raise _refusal(m)
                ex = self._live[gid] = self._exchange(m, deadline)
                ex.started = partial(wire.send, Answered(gid))  # settled as answered, come what may
                tally.ex, tally.instance = ex, m.instance
                try:
                    if gid in self._aborts:  # ended before it began: nothing is sent
                        why, code = self._aborts.pop(gid)
                        raise ended_by_gateway(code, f"{m.where}: {why}")
                    return await surface.run(call, ex, self.config.limits.max_answer_bytes)
                except NotAcceptedError as exc:
                    wire.send(Next(gid, exc.detail or exc.message))
                    ex, asking = None, True
                    self._live[gid] = None
        finally:
            self._asking.pop(gid, None)
            del self._live[gid]
            self._aborts.pop(gid, None)
            if asking:  # an offer on its way is declined: nothing was sent
                wire.send(Gone(gid))
            elif ex is not None:
                out = ex.outcome
                wire.send(End(gid, out.sent, out.completed, out.answered, out.cut))

    def _exchange(self, offer: Offer, deadline: float) -> Exchange:
        url = offer.url
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) >= MAX_URLS:
                self._urls.clear()  # instances' addresses changed (hosts came back): start over
            parsed = self._urls[url] = URL(url)
        ex = Exchange(
            self.engines,
            parsed,
            offer.headers,
            where=offer.where,
            deadline=deadline,
            idle_timeout=self.config.queue.stream_idle_timeout,
            drains=self.drains,
        )
        if offer.abortable:
            ex.abortable()
        return ex

    def record(self, tally: Tally) -> None:
        self.wire.send(Counts(tally.figures()))


def _slot(tally: Tally, call: Call, asked_at: float, waited: float | None, gated: bool) -> None:
    """The request's slot as the authority timed it (``waited``: from its ADMIT's arrival
    there), placed on this worker's clock from when the ADMIT left."""
    if tally.slot is None and waited is not None:
        tally.slot, tally.launched, tally.gated = asked_at + waited, call.dep.launched, gated


def _refusal(m: Refused) -> GatewayError:
    cls = EngineError if m.engine else GatewayError
    return cls(m.message, status=m.status, code=m.code, retryable=m.retryable, detail=m.detail)


async def _by(asked: asyncio.Future[Offer | Refused], deadline: float) -> Offer | Refused:
    """The authority's word on a request, by the request's deadline (and `WORD_GRACE_S`): a
    frozen authority's requests are answered 503 at their deadline, not when it wakes."""
    try:
        async with asyncio.timeout_at(deadline + WORD_GRACE_S):
            return await asked
    except TimeoutError:
        raise UnavailableError(
            "no word from the gateway's authority within queue.request_deadline"
        ) from None
