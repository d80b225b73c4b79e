"""What a runner kind's room is given and owes (``_runners.py`` opens one per kind): `Opened`,
what the fleet has opened that a room may use; `Room`, what a room does (make its runners
whole, take up a previous run's engines once the lifecycle exists); `Found`, how it tells the
lifecycle of an engine found or gone unasked.

Never imports the HTTP surface, the relay, the lifecycle or the runner rooms.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp

from canopyx_provider import Collector

from .._config import Deployment, GatewayConfig, Instance
from .._store import Store
from .routes import EngineInstance
from .runner import Runner
from .settle import Settlement

__all__ = ["Found", "Opened", "Room"]


Found = Callable[[EngineInstance, str, str | None], None]
"""The lifecycle's ear for an engine found (``ready``, ``parked``) or gone (``stopped``,
``failed``) without its asking: `Lifecycle.found`."""


@dataclass(frozen=True, slots=True)
class Opened:
    """What the fleet has opened that a runner kind's room may use."""

    config: GatewayConfig
    collector: Collector
    session: aiohttp.ClientSession
    settlement: Settlement
    log_dir: Path
    clock: Callable[[], float]
    """The settlement's and the collector's clock (``_clock.wall``)."""
    loop_time: Callable[[], float]
    store: Store | None
    env: Mapping[str, str] = field(default_factory=dict)
    """The gateway's environment (where a cluster's credentials may be named)."""
    stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    """Where a room closes what it opened, after the lifecycle has stopped its engines."""
    faults: Counter[str] = field(default_factory=Counter)
    """Where defects in a room's own background tasks are counted (the lifecycle's count)."""
    warm_dir: Path | None = None
    """Where the engines' warm caches are kept (``<state-dir>/warm``); None without a state
    directory (no warm cache then)."""

    def deployment(self, inst: EngineInstance) -> Deployment:
        """The configured deployment ``inst`` was built from."""
        dep = self.config.deployment(inst.deployment)
        if dep is None:
            raise AssertionError(f"{inst.where} was built from no deployment")
        return dep


class Room(Protocol):
    """One runner kind's room, opened for a fleet (``_runners.py`` opens it)."""

    def runner(self, inst: EngineInstance, configured: Instance) -> Runner:
        """The runner of the built instance ``inst``, made whole."""
        ...

    async def take_up(self, found: Found) -> None:
        """Once the routes and the lifecycle exist, before any engine starts: take up what a
        previous run left (or outlast it), and tell ``found`` from now on of an engine found
        or gone without the lifecycle's asking."""
        ...
