"""Placing a request: the one way a request gets a running slot of its deployment's queue and an
instance to run on, whichever process relays it.

`place` waits for the slot (a launched deployment that serves nothing is asked to start, and its
requests wait for it), then offers the request to the deployment's instances, chosen from its
routing facts (`Facts`) and their load: an offer the engine provably never got
(`NotAcceptedError`) goes to the next instance, up to `MAX_OFFERS`, or, where none is left and
the engine that refused it is one the gateway runs (it exited, and is about to be started
again), waits for an instance to open within the deadline; any other ending is the answer. What
an offer does is the caller's ``attempt``: one process runs the exchange itself
(``_http/offer.py``'s `LocalDesk`); with several workers the authority hands the offer to the
worker that holds the client (``_workers/``). Either way each offer is charged to its instance
(`Charge`) by the attempt while it runs.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from .._clock import stamp
from .._deployments.routes import EngineInstance, Facts, Route
from .._errors import EngineError, NotAcceptedError, UnavailableError
from .._fleet import Fleet
from .._loop import running_loop
from .._tally import Tally
from .choose import Choice, choose
from .lines import Named, candidates, log_route, skipped

__all__ = ["EXIT_SEEN_S", "MAX_OFFERS", "Placing", "place"]

MAX_OFFERS = 4
"""Instances a request is offered to, when the ones before provably never got it."""

T = TypeVar("T")


class Placing(Named, Protocol):
    """What placing a request knows of it: what its router lines name, and its routing facts
    (a `Call` in one process; the authority's `Grant` for a worker's request)."""

    @property
    def facts(self) -> Facts: ...


async def place(
    fleet: Fleet,
    asked: Placing,
    tally: Tally,
    deadline: float,
    attempt: Callable[[EngineInstance, Route], Awaitable[T]],
) -> T:
    """Take a running slot of ``asked``'s deployment by ``deadline`` and offer the request to
    its instances with ``attempt`` (which raises `NotAcceptedError` for the next instance).
    Sets ``tally``'s launched, gated and slot."""
    name = asked.dep.name
    route = fleet.routes[name]
    if asked.dep.launched:
        tally.launched, tally.gated = True, not route.queue.open
        fleet.lifecycle.want(name)  # refused now, or waits in the queue for its start
    async with route.queue.slot(deadline, asked.facts.priority):
        tally.slot = stamp()
        return await _offer(route, asked, deadline, attempt, lambda: fleet.lifecycle.want(name))


async def _offer(
    route: Route,
    asked: Placing,
    deadline: float,
    attempt: Callable[[EngineInstance, Route], Awaitable[T]],
    want: Callable[[], None],
) -> T:
    name = asked.dep.name
    if all(i.unusable for i in route.instances):
        raise UnavailableError(
            f"deployment {name}: its instances failed their startup checks "
            "(see the gateway's log or `capyctl-gateway status deployment`)",
            detail="; ".join(f"{i.where}: {i.unusable}" for i in route.instances),
        )
    refused: dict[int, int] = {}
    """Each instance whose engine provably never got the request, with its `opened` then."""
    details: list[str] = []
    loop = running_loop()
    refused_at = 0.0
    while len(refused) < MAX_OFFERS:
        excluded = {i for i, opened in refused.items() if route.instances[i].opened == opened}
        choice = choose(route, asked.facts, excluded)
        if choice is None:
            until = deadline
            if excluded:
                back = _coming_back(route, excluded, refused_at)
                if back is None:
                    break
                until = min(deadline, back)
            # None may take it now (its host is gone, its engine is parking, or the engine
            # that refused it exited: it starts again): wait for one.
            if not await route.waiters.wait(until - loop.time()):
                if until < deadline:
                    break  # its exit was not seen: a refusal like any other
                raise UnavailableError(
                    f"deployment {name}: no instance could take the request within "
                    "queue.request_deadline",
                    detail="; ".join([*details, *skipped(route)]),
                )
            if excluded and asked.dep.launched:
                want()  # an operator's stop meanwhile refuses it; a restart is under way
            continue
        instance = choice.instance
        _log_choice(asked, route, choice, excluded)
        if route.prefixes is not None and asked.facts.prefix:
            route.prefixes.note(asked.facts.prefix, instance.index)
        try:
            return await attempt(instance, route)
        except NotAcceptedError as exc:
            # The engine never saw it: another instance may serve it, within the deadline, or
            # this one once it has started again.
            refused[instance.index] = instance.opened
            refused_at = loop.time()
            route.not_accepted(instance)
            details.append(exc.detail or exc.message)
            log_route("router_failover", asked, route, instance, exc.detail)
    raise EngineError(
        f"deployment {name}: its instances could not be reached",
        detail="; ".join(details) or "no instance to send it to",
    )


EXIT_SEEN_S = 1.0
"""How long a request refused by a launched engine's port waits for that engine's exit to be
seen (measured: 30-38 ms from the exit) before it takes the refusal as any other."""


def _coming_back(route: Route, excluded: set[int], refused_at: float) -> float | None:
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


def _log_choice(asked: Placing, route: Route, choice: Choice, refused: set[int]) -> None:
    """The ``router_selection`` line: with why, the candidates weighed and the instances
    skipped when there was a choice (or the instance is on a host)."""
    instance = choice.instance
    warm: dict[str, Any] = {}
    if instance.restored is not None:  # the first request since its engine's warm restore
        warm["warm_cache"], instance.restored = instance.restored, None
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
