"""The server's side of several machines: the control listener, one session per host, orders,
and what the hosts report.

A remote instance takes requests while its host's session is live and its host reports its
gate open; it is then addressed at the host's ingress with that gate key. A report also carries
the engine's load (for routing) and is the evidence that settles cut requests: a sample taken
after the cut (its age and the session's worst recent round trip are both taken off the time
it arrived) in which the ingress has nothing in flight and the engine runs and waits for
nothing; or a new engine process, or none, after the cut.

Never imports the HTTP surface, the relay or the lifecycle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from .._config import GatewayConfig
from .._deployments.routes import EngineInstance, Route
from .._deployments.settle import Settlement
from .._log import event
from .control import HostSession, control_app
from .enroll import Invites, ServerIdentity
from .protocol import (
    STALE_AFTER_S,
    InstanceReport,
    ingress_path,
)

__all__ = ["HostGoneError", "HostSession", "Machines", "RemoteSample"]

logger = logging.getLogger("capyctl_gateway")


class HostGoneError(Exception):
    """An order could not be carried out: the host has no session, or lost it meanwhile."""


@dataclass(frozen=True, slots=True)
class RemoteSample:
    report: InstanceReport
    received_at: float
    """Loop time the report arrived."""
    received_wall: float
    """The same on the settlement's clock."""


class Machines:
    """The hosts of one server."""

    def __init__(
        self,
        config: GatewayConfig,
        routes: dict[str, Route],
        settlement: Settlement,
        *,
        identity: ServerIdentity,
        invites: Invites,
        clock: Callable[[], float] = time.time,
        on_report: Callable[[EngineInstance, InstanceReport], None] | None = None,
    ) -> None:
        self.config = config
        self._settlement = settlement
        self.identity = identity
        self.invites = invites
        self.clock = clock
        self._on_report = on_report
        self.instances: dict[tuple[str, int], EngineInstance] = {
            (i.deployment, i.index): i for r in routes.values() for i in r.instances if i.remote
        }
        self._routes = routes
        self.sessions: dict[str, HostSession] = {}
        self.samples: dict[str, RemoteSample] = {}
        self._up: dict[str, asyncio.Event] = {h: asyncio.Event() for h in config.hosts}
        self._closing: set[asyncio.Task[bool]] = set()
        self.observers: list[Callable[[EngineInstance, InstanceReport], None]] = []
        """Called with each instance report once applied (tests)."""

    # -- what routing and status read --------------------------------------------------------
    def fresh(self, inst: EngineInstance, now: float) -> InstanceReport | None:
        s = self.samples.get(inst.key)
        if s is None or inst.remote not in self.sessions or s.report.age_s is None:
            return None
        if now - s.received_at + s.report.age_s > STALE_AFTER_S:
            return None
        return s.report

    def session_state(self, host: str) -> str:
        return "live" if host in self.sessions else "lost"

    def app(self) -> web.Application:
        """The control listener's application (serve it with the control TLS context)."""
        return control_app(self)

    def up(self, session: HostSession) -> None:
        """A host's session is established."""
        self.sessions[session.name] = session
        self._up.setdefault(session.name, asyncio.Event()).set()

    # -- orders -------------------------------------------------------------------------------
    async def order(self, inst: EngineInstance, op: str, reason: str, within: float) -> None:
        """Have the instance's host start, park, wake or stop it; return once done.

        Waits for the host's session (all within ``within`` seconds). Raises HostGoneError, or
        RuntimeError with the host's words when the host could not do it."""
        host = inst.remote
        assert host is not None
        loop = asyncio.get_running_loop()
        end = loop.time() + within
        session = self.sessions.get(host)
        if session is None:
            try:
                await asyncio.wait_for(self._up[host].wait(), within)
            except TimeoutError:
                raise HostGoneError(f"host {host} has no session with this server") from None
            session = self.sessions.get(host)
            if session is None:
                raise HostGoneError(f"host {host} lost its session")
        n = next(session.ids)
        done: asyncio.Future[dict[str, Any]] = loop.create_future()
        session.pending[n] = done
        msg = {"t": "order", "id": n, "op": op, "deployment": inst.deployment,
               "instance": inst.index, "reason": reason}  # fmt: skip
        try:
            await session.ws.send_bytes(orjson.dumps(msg))
            answer = await asyncio.wait_for(done, max(end - loop.time(), 0.1))
        except TimeoutError:
            raise HostGoneError(f"host {host} did not carry out {op} in time") from None
        except ConnectionError:
            raise HostGoneError(f"host {host} lost its session") from None
        finally:
            session.pending.pop(n, None)
        report = answer.get("report")
        if isinstance(report, dict):
            self.apply(session, InstanceReport.from_json(report), loop.time())
        if not answer.get("ok"):
            raise RuntimeError(str(answer.get("error") or f"{op} failed"))

    def apply(self, session: HostSession, report: InstanceReport, now: float) -> None:
        """Take in one instance's report from ``session`` (ignored once it is not the host's
        current session): its address and gate, its load, the evidence it brings."""
        inst = self.instances.get((report.deployment, report.instance))
        if (
            inst is None
            or inst.remote != session.name
            or self.sessions.get(inst.remote) is not session
        ):
            return
        before = self.samples.get(inst.key)
        self.samples[inst.key] = RemoteSample(report, now, self.clock())
        inst.gate_open = report.gate is not None
        if report.gate is not None:
            url = session.ingress + ingress_path(inst.deployment, inst.index)
            if inst.url != url:
                inst.bind(url)  # once per session, not once per report
            inst.headers["Authorization"] = f"Bearer {report.gate}"
            # An engine someone else runs takes requests while its gate is open; a launched
            # one when the lifecycle says so too (a report never reopens one being drained).
            if inst.launch is None and not inst.available:
                inst.available = True
                self._routes[inst.deployment].notify()
        else:
            inst.available = False
        _settle(self._settlement, inst, before, report, session)
        if self._on_report is not None:
            self._on_report(inst, report)
        for observe in self.observers:
            observe(inst, report)

    def lost(self, session: HostSession, why: str) -> None:
        host = session.name
        if self.sessions.get(host) is not session:
            return
        del self.sessions[host]
        self._up[host] = asyncio.Event()
        for fut in session.pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError(why))
        for inst in self.instances.values():
            if inst.remote == host:
                inst.available = False
                for ex in list(inst.exchanges):
                    ex.abort(f"host {host} lost its session")
        event("host_session", "host %s: session lost (%s)", host, why, host=host,
              state="lost", reason=why)  # fmt: skip
        closing = asyncio.get_running_loop().create_task(session.ws.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)


def _settle(
    settlement: Settlement,
    inst: EngineInstance,
    before: RemoteSample | None,
    report: InstanceReport,
    session: HostSession,
) -> None:
    """Settle what the report proves done: with its engine stopped or replaced since the
    report before, every request sent before that report; with a quiet sample taken after
    the host received ping n, every request that had answered and was cut before the
    server sent ping n."""
    if not inst.ledger.cut:
        return
    restarted_before = None
    if report.state in ("stopped", "failed"):
        restarted_before = settlement.now()
    elif before is not None and before.report.generation != report.generation:
        restarted_before = before.received_wall
    idle_after = None
    quiet = report.quiet_ping
    if quiet is not None and report.running == 0 and report.waiting == 0:
        idle_after = session.pinged.get(quiet)
    settlement.remote(inst.ledger, idle_after=idle_after, restarted_before=restarted_before)


def _refuse(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"code": code, "message": message}, status=status)
