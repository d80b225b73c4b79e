"""Hosts as a runner kind, as the registry opens it (``_runners.py``): one link per host the
configuration names (instances or not: the server's control listener takes their sessions),
and a host runner per instance, kept by its host's link, which hands it its host's reports."""

from __future__ import annotations

from .._config import Instance
from .._deployments.kinds import Found, Opened
from .._deployments.routes import EngineInstance
from .runner import HostLink, HostRunner

__all__ = ["HostRoom"]


class HostRoom:
    """The server's hosts and the engines they run for it."""

    def __init__(self, opened: Opened) -> None:
        self._opened = opened
        self.links = {name: HostLink(name) for name in sorted(opened.config.hosts)}
        """host name -> the server's link to it."""

    @classmethod
    async def open(cls, opened: Opened) -> HostRoom:
        return cls(opened)

    def runner(self, inst: EngineInstance, configured: Instance) -> HostRunner:
        name = configured.host or ""
        link = self.links.setdefault(name, HostLink(name))
        runner = HostRunner(inst, link, self._opened.settlement, loop_time=self._opened.loop_time)
        link.runners[(inst.deployment, inst.index)] = runner
        return runner

    async def take_up(self, found: Found) -> None:
        """Nothing to take up here: each host reports what it runs when its session opens."""
