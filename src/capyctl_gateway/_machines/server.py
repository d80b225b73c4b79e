"""The server's side of several machines: the control listener, one session per host, and
what the hosts report.

A host's instances take requests while its session is live and it reports their gates open;
each is then addressed at the host's ingress with that gate key (`HostRunner`). A report also
carries the engine's load (for routing) and is the evidence that settles cut requests: a sample
taken after the cut (its age and the session's worst recent round trip are both taken off the
time it arrived) in which the ingress has nothing in flight and the engine runs and waits for
nothing; or a new engine process, or none, after the cut. What a report says of a launched
engine's state goes to the lifecycle (``found``).

Never imports the HTTP surface, the relay or the lifecycle.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from .._clock import wall
from .._config import GatewayConfig
from .._deployments.routes import EngineInstance
from .._log import event
from .control import HostSession
from .enroll import Invites, ServerIdentity
from .protocol import InstanceReport
from .runner import HostLink

__all__ = ["HostSession", "Machines"]

logger = logging.getLogger("capyctl_gateway")


class Machines:
    """The hosts of one server."""

    def __init__(
        self,
        config: GatewayConfig,
        links: dict[str, HostLink],
        *,
        identity: ServerIdentity,
        invites: Invites,
        found: Callable[[EngineInstance, str, str | None], None],
        clock: Callable[[], float] = wall,
    ) -> None:
        """``found(instance, state, failure)``: where what a host reports of a launched
        engine's state goes (`Lifecycle.found`)."""
        self.config = config
        self.links = links
        self.identity = identity
        self.invites = invites
        self.clock = clock
        self._found = found
        self._closing: set[asyncio.Task[bool]] = set()
        self.observers: list[Callable[[EngineInstance, InstanceReport], None]] = []
        """Called with each instance report once applied (tests)."""

    @property
    def sessions(self) -> dict[str, HostSession]:
        """Each host's live session."""
        return {n: link.session for n, link in self.links.items() if link.session is not None}

    def session_state(self, host: str) -> str:
        link = self.links.get(host)
        return "live" if link is not None and link.live else "lost"

    def up(self, session: HostSession) -> None:
        """A host's session is established."""
        link = self.links.get(session.name)
        if link is None:  # enrolled, but placed nowhere in this configuration
            link = self.links[session.name] = HostLink(session.name)
        link.up(session)

    def apply(self, session: HostSession, report: InstanceReport, now: float) -> None:
        """Take in one instance's report from ``session`` (ignored once it is not the host's
        current session)."""
        link = self.links.get(session.name)
        runner = link.runners.get((report.deployment, report.instance)) if link else None
        if link is None or runner is None or link.session is not session:
            return
        runner.take(session, report, now)
        inst = runner.instance
        if inst.launch is not None:
            self._found(inst, report.state, report.failure)
        for observe in self.observers:
            observe(inst, report)

    def lost(self, session: HostSession, why: str) -> None:
        host = session.name
        link = self.links.get(host)
        if link is None or link.session is not session:
            return
        link.down()
        for fut in session.pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError(why))
        for runner in link.runners.values():
            runner.lost(why)
        event(
            "host_session",
            "host %s: session lost (%s)",
            host,
            why,
            host=host,
            state="lost",
            reason=why,
        )
        closing = asyncio.get_running_loop().create_task(session.ws.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
