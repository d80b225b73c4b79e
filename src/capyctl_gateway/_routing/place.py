"""Placing a request: the one way a request gets a running slot of its deployment's queue and an
instance to run on, whichever process relays it.

`place` waits for the slot (a launched deployment that serves nothing is asked to start, and its
requests wait for it), then offers the request to the deployment's instances, chosen from its
routing facts (`Facts`) and their load: an offer the engine provably never got
(`NotAcceptedError`) goes to the next instance, up to `MAX_OFFERS`, or, where none is left and
the engine that refused it is one the gateway runs (it exited, and is about to be started
again), waits for an instance to open within the deadline; any other ending is the answer. A
request of a deployment with spares that no instance takes decides about its spare again
before it waits (`_spare_again`). The caller runs each offer inline (`place`'s own text): one
process runs the exchange itself (``_http/offer.py``'s `LocalDesk`); with several workers the
authority hands the offer to the worker that holds the client (``_workers/``). Either way each
offer is charged to its instance (`Charge`) while it runs.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Protocol

from .. import _clock
from .._deployments.routes import EngineInstance, Facts, Route
from .._errors import EngineError, NotAcceptedError, UnavailableError
from .._fleet import Fleet
from .._lifecycle.spares import Spare, wake_or_queue
from .._loop import running_loop
from .._tally import Tally
from .choose import Choice, choose
from .lines import Named, candidates, log_route, skipped

__all__ = ["EXIT_SEEN_S", "MAX_OFFERS", "Placing", "place"]

MAX_OFFERS = 4
"""Instances a request is offered to, when the ones before provably never got it."""


class Placing(Named, Protocol):
    """What placing a request knows of it: what its router lines name, and its routing facts
    (a `Call` in one process; the authority's `Grant` for a worker's request)."""

    @property
    def facts(self) -> Facts: ...


class place:  # noqa: N801 (used as a function: ``async with place(...) as offers``)
    """A request's running slot and its offers to its deployment's instances, each run inline
    by its caller, one way down and back (as stamina's ``retry_context``)::

        async with place(fleet, asked, tally, deadline) as offers:
            async for offer in offers:
                with offer:  # a NotAcceptedError here: the next instance
                    return await run(offer.instance, offer.route)
            raise offers.failure()

    Entering waits for the slot until ``deadline`` (a launched deployment that serves nothing
    is asked to start first; sets ``tally``'s launched, gated and slot); leaving gives it back.
    Each offer is this object, its instance chosen (`choose`) and logged; the offers end once
    `MAX_OFFERS` instances refused, or every one refused and none is coming back."""

    __slots__ = (
        "_asked", "_deadline", "_details", "_fleet", "_offers", "_refused", "_refused_at", "_spare",
        "_tally", "instance", "route",
    )  # fmt: skip

    def __init__(self, fleet: Fleet, asked: Placing, tally: Tally, deadline: float) -> None:
        self._fleet, self._asked, self._tally, self._deadline = fleet, asked, tally, deadline
        self.route = fleet.routes[asked.dep.name]
        self.instance: EngineInstance | None = None
        """The instance of the offer under way."""
        self._refused: dict[int, int] = {}
        """Each instance whose engine provably never got the request, with its `opened` then."""
        self._details: list[str] = []
        self._refused_at = 0.0
        self._offers = 0
        """Offers made less those refused: 1 while one is under way or ended otherwise."""
        self._spare: Spare | None = None
        """What it did about a rested spare of its deployment (``_lifecycle/spares.py``)."""

    async def __aenter__(self) -> place:
        asked, tally = self._asked, self._tally
        if asked.dep.launched:
            tally.launched, tally.gated = True, not self.route.queue.open
            self._fleet.lifecycle.want(asked.dep.name)  # refused now, or waits for its start
        await self.route.queue.acquire(self._deadline, asked.facts.priority)
        tally.slot = _clock.now()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.route.queue.release()

    def __aiter__(self) -> place:
        return self

    async def __anext__(self) -> place:
        route, asked, name = self.route, self._asked, self._asked.dep.name
        if self._offers:  # the last offer ended otherwise than refused: it was the answer
            raise StopAsyncIteration
        first = route.instances[0].unusable if route.instances else True  # none: no generator
        if first and not self._refused:
            _usable(route, name)
        refused, loop = self._refused, running_loop()
        spares = not refused and asked.dep.lifecycle.spare_idle_timeout is not None
        if spares:
            self._spare = await _wake_or_queue(self._fleet, name, self._deadline - loop.time())
        while len(refused) < MAX_OFFERS:
            excluded = _excluded(route, refused) if refused else NONE
            choice = choose(route, asked.facts, excluded)
            if choice is not None:
                _log_choice(asked, route, choice, excluded, self._spare)
                if route.prefixes is not None and asked.facts.prefix:
                    route.prefixes.note(asked.facts.prefix, choice.instance.index)
                self.instance = choice.instance
                self._offers = 1
                return self
            until = self._deadline
            if excluded:
                back = _coming_back(route, excluded, self._refused_at)
                if back is None:
                    break
                until = min(until, back)
            elif spares:
                if (again := await _spare_again(self, name)) is None:
                    continue  # a spare's wake ended: choose again
                until = again
            if asked.dep.launched:  # an operator's stop refuses it; or it starts again
                self._fleet.lifecycle.want(name)
            # None may take it now (its host is gone, its engine is parking, or the engine
            # that refused it exited: it starts again): wait for one.
            if not await route.waiters.wait(until - loop.time()):
                if until < self._deadline:
                    if not excluded:
                        continue  # the spare's backoff is over: decide again
                    break  # its exit was not seen: a refusal like any other
                raise UnavailableError(
                    f"deployment {name}: no instance could take the request within "
                    "queue.request_deadline",
                    detail="; ".join([*self._details, *skipped(route)]),
                )
        raise StopAsyncIteration

    def __enter__(self) -> place:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> bool:
        """An offer the engine provably never got (`NotAcceptedError`): another instance may
        serve it, within the deadline, or this one once it has started again."""
        if not isinstance(exc, NotAcceptedError):
            return False
        instance = self.instance
        assert instance is not None
        self._refused[instance.index] = instance.opened
        self._refused_at = running_loop().time()
        self._offers = 0
        self.route.not_accepted(instance)
        self._details.append(exc.detail or exc.message)
        log_route("router_failover", self._asked, self.route, instance, exc.detail)
        return True

    def failure(self) -> EngineError:
        """What the request is answered once no offer is left."""
        return EngineError(
            f"deployment {self._asked.dep.name}: its instances could not be reached",
            detail="; ".join(self._details) or "no instance to send it to",
        )


EXIT_SEEN_S = 1.0
"""How long a request refused by a launched engine's port waits for that engine's exit to be
seen (measured: 30-38 ms from the exit) before it takes the refusal as any other."""


NONE: frozenset[int] = frozenset()
"""No instance excluded (a request's first offer: no set made for it)."""


def _excluded(route: Route, refused: dict[int, int]) -> set[int]:
    """The instances that refused the request and have not begun to take requests again
    since (each with the `EngineInstance.opened` it had when it refused)."""
    return {i for i, opened in refused.items() if route.instances[i].opened == opened}


def _coming_back(
    route: Route, excluded: set[int] | frozenset[int], refused_at: float
) -> float | None:
    """Until when a request that every instance refused may wait for one to open again: the
    deadline, where an engine the gateway runs refused it and is now seen gone (it exited,
    and the lifecycle starts it again for the requests that wait); `EXIT_SEEN_S` after the
    refusal, where such an engine still looks up (its exit may not be seen yet); None where
    no engine the gateway runs refused it (a host's busy ingress, an engine someone else
    runs: a refusal like any other)."""
    launched = [route.instances[i] for i in excluded if route.instances[i].launch is not None]
    if not launched:
        return None
    if any(not i.available for i in launched):
        return math.inf
    return refused_at + EXIT_SEEN_S


def _usable(route: Route, name: str) -> None:
    """Refuse a request where every instance of deployment ``name`` failed its startup
    checks."""
    if all(i.unusable for i in route.instances):
        raise UnavailableError(
            f"deployment {name}: its instances failed their startup checks "
            "(see the gateway's log or `capyctl-gateway status deployment`)",
            detail="; ".join(f"{i.where}: {i.unusable}" for i in route.instances),
        )


async def _spare_again(placing: place, name: str) -> float | None:
    """None of deployment ``name``'s instances takes ``placing``'s request now: a rested spare
    may, woken now, or once its crash backoff is over. None where a wake ended (choose again);
    else until when to wait for an instance (the deadline, or the backoff's end if sooner)."""
    loop, deadline = running_loop(), placing._deadline
    placing._spare = spare = await _wake_or_queue(placing._fleet, name, deadline - loop.time())
    if spare is not None and spare.wake is not None and spare.wake.done():
        return None
    if spare is None or spare.again_s is None:
        return deadline
    return min(deadline, loop.time() + spare.again_s)


async def _wake_or_queue(fleet: Fleet, name: str, left: float) -> Spare | None:
    """Before a request's first offer: wake a rested spare of its deployment, and wait for the
    wake (``left`` seconds at most), where that is quicker than the queue on the ready ones
    (``_lifecycle/spares.py``); what it did."""
    spare = wake_or_queue(fleet.lifecycle, name)
    if spare is not None and spare.wake is not None:
        await asyncio.wait([spare.wake], timeout=max(left, 0.0))
    return spare


def _log_choice(
    asked: Placing,
    route: Route,
    choice: Choice,
    refused: set[int] | frozenset[int],
    spare: Spare | None,
) -> None:
    """The ``router_selection`` line: with why, the candidates weighed and the instances
    skipped when there was a choice (or the instance is on a host), and what it did about a
    rested spare."""
    instance = choice.instance
    warm: dict[str, Any] = {}
    if instance.restored is not None:  # the first request since its engine's warm restore
        warm["warm_cache"], instance.restored = instance.restored, None
    if spare is not None:
        warm["spare"] = spare.row()
    if len(route.instances) > 1 or asked.dep.remote:
        shown, skipped_ = candidates(route, refused, choice)
        prefix: dict[str, Any] = {}
        if route.prefixes is not None:
            prefix["prefix_blocks"] = len(asked.facts.prefix)
        log_route(
            "router_selection",
            asked,
            route,
            instance,
            why=choice.why,
            **prefix,
            candidates=shown,
            skipped=skipped_,
            **warm,
        )
    else:
        log_route("router_selection", asked, route, instance, **warm)
