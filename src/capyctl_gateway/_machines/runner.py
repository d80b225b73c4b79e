"""An engine on a host (a `Runner`): driven by orders over the host's session, read from its
reports.

`HostLink` is the server's link to one host: its session while it is live, and the orders in
flight on it. `HostRunner` is one instance on that host: it takes each report the host sends of
it (its ingress address and gate key, its load, the evidence that settles cut requests) and
ends the exchanges in flight through the host when the session is lost.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson

from .._deployments.routes import EngineInstance
from .._deployments.runner import (
    CacheCounts,
    Described,
    LoadSample,
    ProcessView,
    Reported,
    Site,
    Tracked,
)
from .._deployments.settle import Settlement, settle_remote
from .._errors import GatewayError, HostGoneError, OrderRefusedError
from .._log import shown
from .control import HostSession
from .protocol import STALE_AFTER_S, InstanceReport, ingress_path

__all__ = ["HostLink", "HostRunner", "RemoteSample"]

ORDER_S = {"start": None, "wake": 600.0, "park": 120.0, "stop": 60.0}
"""How long the host may take to carry out each order (a start: the launch's startup_timeout)."""


@dataclass(frozen=True, slots=True)
class RemoteSample:
    report: InstanceReport
    received_at: float
    """Loop time the report arrived."""
    received_wall: float
    """The same on the settlement's clock."""


class HostLink:
    """The server's link to one host."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.session: HostSession | None = None
        self.runners: dict[tuple[str, int], HostRunner] = {}
        self._up = asyncio.Event()

    @property
    def live(self) -> bool:
        return self.session is not None

    def up(self, session: HostSession) -> None:
        self.session = session
        self._up.set()

    def down(self) -> None:
        self.session = None
        self._up = asyncio.Event()

    async def order(self, inst: EngineInstance, op: str, reason: str, within: float) -> Any:
        """Have the host carry out ``op`` on ``inst``; its answer (the ``done`` message).

        Waits for the host's session (all within ``within`` seconds). Raises HostGoneError."""
        loop = asyncio.get_running_loop()
        end = loop.time() + within
        if self.session is None:
            try:
                await asyncio.wait_for(self._up.wait(), within)
            except TimeoutError:
                raise HostGoneError(f"host {self.name} has no session with this server") from None
        session = self.session
        if session is None:
            raise HostGoneError(f"host {self.name} lost its session")
        n = next(session.ids)
        done: asyncio.Future[dict[str, Any]] = loop.create_future()
        session.pending[n] = done
        msg = {
            "t": "order",
            "id": n,
            "op": op,
            "deployment": inst.deployment,
            "instance": inst.index,
            "reason": reason,
        }
        try:
            await session.ws.send_bytes(orjson.dumps(msg))
            return await asyncio.wait_for(done, max(end - loop.time(), 0.1))
        except TimeoutError:
            raise HostGoneError(f"host {self.name} did not carry out {op} in time") from None
        except ConnectionError:
            raise HostGoneError(f"host {self.name} lost its session") from None
        finally:
            session.pending.pop(n, None)


class HostRunner(Reported):
    """One instance's engine on a host."""

    def __init__(
        self, inst: EngineInstance, link: HostLink, settlement: Settlement, *, loop_time: Any
    ) -> None:
        self._inst, self._link, self._settlement, self._time = inst, link, settlement, loop_time
        self.host = link.name
        self.site = Site(
            pool=f"host {link.name}",
            machine=link.name,
            on=f"on host {link.name}",
            stopper="its host",
            outlives_gateway=True,
            reported=f"host {link.name} has not reported yet",
        )
        self.latest: RemoteSample | None = None

    @property
    def instance(self) -> EngineInstance:
        return self._inst

    # -- what it reads ------------------------------------------------------------------------
    def fresh(self) -> tuple[InstanceReport, float] | None:
        """The latest report while its sample is fresh, with the sample's age now."""
        s, age = self.latest, self._age()
        if s is None or age is None or age > STALE_AFTER_S:
            return None
        return s.report, age

    def stale(self) -> bool:
        """The host reported a sample of its engine that has since gone old (not: it has not
        sampled it yet, nor: the session is lost, which takes the instance out)."""
        age = self._age()
        return age is not None and age > STALE_AFTER_S

    def _age(self) -> float | None:
        s = self.latest
        if s is None or not self._link.live or s.report.age_s is None:
            return None
        age: float = self._time() - s.received_at + s.report.age_s
        return age

    def sample(self) -> LoadSample | None:
        fresh = self.fresh()
        if fresh is None:
            return None
        r, age = fresh
        return LoadSample(r.running, r.waiting, r.usage, age, f"host {self.host}")

    def prefix_cache(self) -> CacheCounts | None:
        return self.latest.report.cache_counts() if self.latest is not None else None

    def process(self) -> ProcessView | None:
        r = self.latest.report if self.latest is not None else None
        if r is None or r.pid is None or r.command is None:
            return None
        return ProcessView(r.pid, r.port, r.command)

    def describe(self) -> Described:
        """The engine as the host last reported it: the session, the engine's state and load
        with their ages, the ingress's requests in flight, the process, and why it failed."""
        live = self._link.live
        link = "live" if live else "lost"
        row: dict[str, Any] = {"session": link}
        s = self.latest
        if s is None:
            return Described(fields=row, link=link)
        r = s.report
        row["report_age_s"] = round(self._time() - s.received_at, 3)
        seen = self.fresh()
        if seen is not None:
            row["running"], row["waiting"] = seen[0].running, seen[0].waiting
            row["snapshot_age_s"] = round(seen[1], 3)
        if (counts := self.prefix_cache()) is not None:
            row["prefix_cache"] = counts.row()
        row["ingress_in_flight"] = r.ingress_in_flight
        if r.pid is not None and r.command is not None:
            row["process"] = {"pid": r.pid, "port": r.port, "command": shown(r.command)}
        if r.failure is not None:
            row["failure"] = r.failure
        watched = "ready" if r.gate is not None and live else r.state
        return Described(watched=watched, fields=row, link=link)

    def log(self) -> None:
        inst = self._inst
        raise GatewayError(
            f"instance {inst.index} of {inst.deployment} runs on host {self.host}: its log is "
            "there",
            status=409,
            code="log_on_host",
        )

    def holdup(self) -> str | None:
        return None

    def why_unreachable(self) -> str:
        return "dispatch_closed" if self._link.live else "host_session_lost"

    def begin(self, exchange: Tracked) -> None:
        exchange.abortable()  # a lost session ends it even before its answer's head

    def end(self, exchange: Tracked) -> None:
        """The instance's own ``inflight`` (kept by its `Charge`) is what `lost` ends."""

    # -- reports and the session --------------------------------------------------------------
    def take(self, session: HostSession, report: InstanceReport, now: float) -> None:
        """One report of this instance from its host's current session."""
        inst = self._inst
        before = self.latest
        self.latest = RemoteSample(report, now, self._settlement.now())
        if report.gate is not None:
            url = session.ingress + ingress_path(inst.deployment, inst.index)
            if inst.url != url:
                inst.bind(url)  # once per session, not once per report
            inst.headers["Authorization"] = f"Bearer {report.gate}"
            inst.set_open(reachable=True, why=f"host {self.host} opened its gate")
        else:
            inst.set_open(reachable=False, why=f"host {self.host} closed its gate")
        _settle(self._settlement, inst, before, report, session)

    def lost(self, why: str) -> None:
        """The host's session is gone: nothing reaches the engine, and what was in flight
        through it ends now."""
        self._inst.set_open(reachable=False, why=f"host {self.host}: {why}")
        for ex in list(self._inst.inflight):
            ex.abort(f"host {self.host} lost its session")

    # -- what it does -------------------------------------------------------------------------
    async def _order(self, op: str, reason: str) -> None:
        launch = self._inst.launch
        within = ORDER_S[op] or (launch.startup_timeout if launch is not None else 60.0)
        answer = await self._link.order(self._inst, op, reason, within)
        report = answer.get("report")
        session = self._link.session
        if isinstance(report, dict) and session is not None:
            self.take(session, InstanceReport.from_json(report), self._time())
        if not answer.get("ok"):
            raise OrderRefusedError(str(answer.get("error") or f"{op} failed"))

    def cannot_start(self) -> str | None:
        return None  # a host without a session fails the order itself, with its reason

    async def start(self, reason: str) -> str:
        await self._order("start", reason)
        return f"{reason} (on host {self.host})"

    async def park(self, reason: str) -> None:
        await self._order("park", reason)

    async def wake(self, reason: str) -> None:
        await self._order("wake", reason)

    async def stop(self, reason: str) -> bool:
        await self._order("stop", reason)
        return True  # its host confirmed it: nothing it counted can still run

    def exited(self) -> str | None:
        return None  # a host reports its engine's exit (`Lifecycle.found`)


def _settle(
    settlement: Settlement,
    inst: EngineInstance,
    before: RemoteSample | None,
    report: InstanceReport,
    session: HostSession,
) -> None:
    """Settle what the report proves done: with its engine stopped or replaced since the
    report before (a new generation: a launched engine's new process, or a restart its host's
    collector proved of an engine someone else runs), every request sent before that report;
    with a quiet sample taken after the host received ping n, every request that had answered
    and was cut before the server sent ping n. A request cut before its first token waits for
    the first, as on one machine."""
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
    settle_remote(settlement, inst.ledger, idle_after=idle_after, restarted_before=restarted_before)
