"""This machine's runner kind, as the registry opens it (``_runners.py``): the local runners,
and the records of a previous run's engines, outlasted before this run starts any; the warm
caches of deployments no longer configured (or keeping none), removed when it opens."""

from __future__ import annotations

import asyncio
import logging

from .._config import Instance
from .._deployments.kinds import Found, Opened
from .._deployments.routes import EngineInstance
from .pids import outlast
from .runner import LocalRunner
from .warm import WarmCache
from .warmfiles import prune

__all__ = ["LocalRoom"]

logger = logging.getLogger("capyctl_gateway")


class LocalRoom:
    """The engines this gateway runs on its own machine."""

    def __init__(self, opened: Opened) -> None:
        self._opened = opened
        self._warm_locks: dict[str, asyncio.Lock] = {}
        """One per deployment: its instances' saves share its disk budget."""

    @classmethod
    async def open(cls, opened: Opened) -> LocalRoom:
        if opened.warm_dir is not None:  # a deployment gone (or its warm cache off): its files
            names = [d.name for d in opened.config.deployments if d.warms]
            for gone in await asyncio.to_thread(prune, opened.warm_dir, names):
                logger.info("warm cache of a deployment no longer keeping one removed: %s", gone)
        return cls(opened)

    def runner(self, inst: EngineInstance, configured: Instance) -> LocalRunner:
        o = self._opened
        d = o.deployment(inst)
        lock = self._warm_locks.setdefault(d.name, asyncio.Lock())
        warm = WarmCache(inst, d, root=o.warm_dir, session=o.session, lock=lock)
        return LocalRunner(
            inst,
            d,
            collector=o.collector,
            session=o.session,
            log_dir=o.log_dir,
            clock=o.clock,
            store=o.store,
            warm=warm,
        )

    async def take_up(self, found: Found) -> None:
        if self._opened.store is not None:  # a previous run's engines go before any starts
            await outlast(self._opened.store)
