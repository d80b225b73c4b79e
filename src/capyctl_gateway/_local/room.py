"""This machine's runner kind, as the registry opens it (``_runners.py``): the local runners,
and the records of a previous run's engines, outlasted before this run starts any."""

from __future__ import annotations

from .._config import Instance
from .._deployments.kinds import Found, Opened
from .._deployments.routes import EngineInstance
from .pids import outlast
from .runner import LocalRunner

__all__ = ["LocalRoom"]


class LocalRoom:
    """The engines this gateway runs on its own machine."""

    def __init__(self, opened: Opened) -> None:
        self._opened = opened

    @classmethod
    async def open(cls, opened: Opened) -> LocalRoom:
        return cls(opened)

    def runner(self, inst: EngineInstance, configured: Instance) -> LocalRunner:
        o = self._opened
        return LocalRunner(
            inst,
            o.deployment(inst),
            collector=o.collector,
            session=o.session,
            log_dir=o.log_dir,
            clock=o.clock,
            store=o.store,
        )

    async def take_up(self, found: Found) -> None:
        if self._opened.store is not None:  # a previous run's engines go before any starts
            await outlast(self._opened.store)
