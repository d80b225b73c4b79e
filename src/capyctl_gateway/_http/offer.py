"""Where the public handlers take a checked request: a `Desk` places it (``_routing/place.py``)
and runs it, and takes its counts once it is answered. `LocalDesk` is one process: the request
is placed on this process's fleet and its exchange runs here, charged to its instance while it
runs (`Charge`) and left as a cut request when it may still run there. With several workers a
worker's desk asks the authority instead (``_workers/desk.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from aiohttp import web

from .._deployments.charge import Charge
from .._gateway import Gateway
from .._relay.exchange import Exchange
from .._routing.place import place
from .._tally import Tally, record
from .calls import Call

if TYPE_CHECKING:
    from .inference import Surface

__all__ = ["Desk", "LocalDesk"]


class Desk(Protocol):
    """Where the public handlers take a checked request to be placed and run, and leave its
    counts: this process's fleet (`LocalDesk`), or the authority of several workers."""

    async def serve(self, call: Call, surface: Surface, deadline: float) -> web.StreamResponse:
        """Place ``call`` and run it with ``surface``; a refusal raises `GatewayError`."""
        ...

    def record(self, tally: Tally) -> None:
        """Add a request's counts, once it is answered or its client has gone."""
        ...


class LocalDesk:
    """One process: the request is placed on this process's fleet and relayed here."""

    __slots__ = ("_gw",)

    def __init__(self, gateway: Gateway) -> None:
        self._gw = gateway

    async def serve(self, call: Call, surface: Surface, deadline: float) -> web.StreamResponse:
        fleet = self._gw.fleet
        config = fleet.config
        async with place(fleet, call, call.tally, deadline) as offers:
            async for offer in offers:
                with offer:
                    instance = offer.instance
                    assert instance is not None
                    ex = Exchange(
                        fleet.engines,
                        surface.url(instance),
                        instance.headers,
                        where=instance.where,
                        deadline=deadline,
                        idle_timeout=config.queue.stream_idle_timeout,
                        drains=fleet.drains,
                    )
                    call.tally.ex, call.tally.instance = ex, instance.index
                    with Charge(instance, ex, call.rid, fleet.settlement):
                        return await surface.run(call, ex, config.limits.max_answer_bytes)
            raise offers.failure()

    def record(self, tally: Tally) -> None:
        record(self._gw.telemetry, tally)
