"""The authority: the one process that decides for every worker what one gateway decides for
itself. A worker asks once per request (``ADMIT``); the authority places it exactly as one
process would (`_routing.place.place`: the deployment's FIFO queue and running bound, one
activation per wave, the choice among instances) and answers with an offer or a refusal. The
offer is charged to its instance here (`Charge`) with a `Grant` standing in for the exchange
the worker runs: the worker's ``END`` says how it ended, and a cut is settled by the same
rules as in one process. An abort (a host lost, the gateway stopping) goes to the worker as
``ABORT``. A worker whose line ends takes its requests with it: those waiting leave the queue,
those running are settled as cut requests.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

from .._config import Api, Deployment, GatewayConfig
from .._config.bounds import fit_workers
from .._deployments.charge import Charge
from .._deployments.routes import EngineInstance, Facts, Route
from .._errors import EngineError, GatewayError, NotAcceptedError
from .._gateway import Gateway
from .._loop import running_loop
from .._routing.place import place
from .._tally import Tally, add
from .messages import (
    Abort,
    Admit,
    Answered,
    Counts,
    End,
    Gone,
    Hello,
    Message,
    Next,
    Offer,
    Ping,
    Pong,
    Ready,
    Refused,
)
from .wire import Wire

__all__ = ["Authority", "Grant", "Line"]

logger = logging.getLogger("capyctl_gateway")

LOST = "its worker process ended"


@dataclass(slots=True)
class Ended:
    """How a worker's exchange ended, as its ``END`` said (what `Charge` settles by)."""

    sent: bool = True
    completed: bool = False
    answered: bool = False
    cut: str | None = None


class Grant:
    """A worker's request as the authority holds it: what its router lines name, and the
    stand-in for its exchange in the instance's in-flight set."""

    __slots__ = (
        "_abortable",
        "caller",
        "dep",
        "facts",
        "gid",
        "line",
        "outcome",
        "rid",
        "tally",
        "verdict",
    )

    def __init__(
        self, line: Line, gid: int, dep: Deployment, rid: str, caller: str | None, facts: Facts
    ) -> None:
        self.line, self.gid, self.dep, self.rid, self.caller = line, gid, dep, rid, caller
        self.facts = facts
        self.outcome = Ended()
        self.verdict: asyncio.Future[str | None] | None = None
        """Set while an offer runs: None when it ended, the reason when it was not taken."""
        self._abortable = False
        self.tally: Tally | None = None
        """Its times here (its slot's, and whether it waited for a start or wake)."""

    def abortable(self) -> None:
        self._abortable = True

    def waited(self) -> tuple[float | None, bool]:
        """Seconds from its arrival here to its running slot (None without one), and whether
        that was a wait for a start or wake: what the worker's counts take as its queue and
        activation timings."""
        t = self.tally
        if t is None or t.slot is None:
            return None, False
        return t.slot - t.arrival, t.gated

    def abort(self, why: str, code: str = "engine_error") -> None:
        self.line.wire.send(Abort(self.gid, why, code))

    async def attempt(self, instance: EngineInstance, route: Route, api: Api) -> None:
        """Offer the request to ``instance`` and wait for the worker's word on it."""
        line = self.line
        self.outcome, self._abortable = Ended(), False
        self.verdict = verdict = running_loop().create_future()
        with Charge(instance, self, self.rid, line.fleet.settlement):
            url = instance.chat_url if api is Api.CHAT else instance.decision_url
            waited, gated = self.waited()
            line.wire.send(
                Offer(
                    self.gid,
                    instance.index,
                    str(url),
                    instance.headers,
                    instance.where,
                    self._abortable,
                    waited,
                    gated,
                )
            )
            try:
                why = await verdict
            except asyncio.CancelledError:  # its line ended while it ran
                if verdict.cancelled():  # no word came from its worker (after one, it stands)
                    self.outcome = Ended(answered=self.outcome.answered, cut=LOST)
                raise
            finally:
                self.verdict = None
        if why is not None:
            raise NotAcceptedError(why, detail=why)


class Line:
    """One worker's line to the authority and the requests it has asked about."""

    def __init__(self, authority: Authority) -> None:
        self.authority = authority
        self.wire = Wire(self._message, self._lost)
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.grants: dict[int, Grant] = {}
        self.ready: asyncio.Future[bool] = running_loop().create_future()
        """True once the worker listens; False when its line ended before."""
        self.fleet = authority.gateway.fleet
        self.answered = 0
        """The last ping the worker answered (its keeper's proof of life: `Authority.late`)."""

    def _message(self, m: Message) -> None:
        if isinstance(m, Admit):
            gid = m.gid
            dep = self.fleet.routes[m.deployment].deployment
            grant = Grant(
                self, gid, dep, m.rid, m.caller, Facts(m.deployment, m.salt, m.prefix, m.priority)
            )
            self.grants[gid] = grant
            task = self.tasks[gid] = running_loop().create_task(
                self._place(grant, Api(m.api), m.left)
            )
            # Forgotten when it ends, however: a task cancelled before its first step (a GONE
            # in the same read as its ADMIT) never runs its body.
            task.add_done_callback(lambda _: self._forget(gid))
        elif isinstance(m, Counts):
            add(self.authority.gateway.telemetry, m.figures, running_loop().time())
        elif isinstance(m, Pong):
            self.answered = max(self.answered, m.n)
        elif isinstance(m, Ready):
            if not self.ready.done():
                self.ready.set_result(True)
        elif isinstance(m, End | Next | Gone):
            self._word(m)
        elif isinstance(m, Answered):
            found = self.grants.get(m.gid)
            if found is not None and found.verdict is not None and not found.verdict.done():
                found.outcome.answered = True  # kept if its worker dies before its END

    def _word(self, m: End | Next | Gone) -> None:
        """A worker's word on a request it asked about: how its offer ended (``END``), that
        the engine never got it (``NEXT``), or that its client went (``GONE``)."""
        found = self.grants.get(m.gid)
        if found is None:
            return  # already refused or ended
        verdict = found.verdict
        if verdict is None or verdict.done():
            if isinstance(m, Gone):  # still waiting for its slot or an instance
                self.tasks[found.gid].cancel()
            return
        if isinstance(m, End):
            found.outcome = Ended(m.sent, m.completed, m.answered, m.cut)
            verdict.set_result(None)
        elif isinstance(m, Next):
            found.outcome = Ended(sent=False)
            verdict.set_result(m.why)
        else:  # its client went before the offer reached it: never sent
            found.outcome = Ended(sent=False)
            verdict.set_result(None)

    async def _place(self, grant: Grant, api: Api, left: float) -> None:
        loop = running_loop()
        tally = grant.tally = Tally(api.value, loop.time())
        try:
            async with place(self.fleet, grant, tally, tally.arrival + left) as offers:
                async for offer in offers:
                    with offer:
                        assert offer.instance is not None
                        return await grant.attempt(offer.instance, offer.route, api)
                raise offers.failure()
        except GatewayError as err:
            self._refuse(grant, err)
        except Exception as exc:  # a fault here must not leave the worker's client waiting
            logger.exception("request %s: placing it failed", grant.rid)
            self._refuse(grant, GatewayError(f"the gateway failed: {type(exc).__name__}"))

    def _refuse(self, grant: Grant, err: GatewayError) -> None:
        waited, gated = grant.waited()
        self.wire.send(
            Refused(
                grant.gid,
                isinstance(err, EngineError),
                err.status,
                err.code,
                err.message,
                err.retryable,
                err.detail,
                waited,
                gated,
            )
        )

    def _forget(self, gid: int) -> None:
        self.grants.pop(gid, None)
        self.tasks.pop(gid, None)

    def _lost(self) -> None:
        """The worker is gone: what it waited for leaves the queue, what ran is cut."""
        for task in list(self.tasks.values()):
            task.cancel()
        if not self.ready.done():
            self.ready.set_result(False)
        self.authority.lines.discard(self)


class Authority:
    """Every worker's line, over the gateway (and fleet) of this process."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.lines: set[Line] = set()
        self.pinging = False
        """Its workers' keeper pings them (``_cli_workers.py``; a test's workers may not)."""
        self._pings = 0

    async def attach(self, sock: socket.socket, index: int, workers: int) -> Line:
        """Open the line to worker ``index`` of ``workers`` over ``sock`` and greet it: the
        configuration, the key and how many workers share the listener's bounds. Wait for
        `Line.ready` before counting on it."""
        line = Line(self)
        line.answered = self._pings  # it owes none of the pings before it
        await running_loop().create_unix_connection(lambda: line.wire, sock=sock)
        self.lines.add(line)
        gateway = self.gateway
        hello = {
            "config": _fitted(gateway.config, workers).model_dump(mode="json"),
            "key": gateway.key_to_share(),
            "workers": workers,
            "index": index,
            "started_at": gateway.started_at,
            "prefix_seed": gateway.prefix_seed,
            "pinged": self.pinging,
        }
        line.wire.send(Hello(hello))
        return line

    def broadcast(self, message: Message) -> None:
        for line in self.lines:
            line.wire.send(message)

    def ping(self) -> None:
        """Ping every worker (every `PING_S`: its answer is its proof of life, and the ping
        its authority's)."""
        self._pings += 1
        self.broadcast(Ping(self._pings))

    def unanswered(self, line: Line) -> int:
        """How many pings in a row ``line``'s worker has not answered: counted in pings, not
        seconds, so that a stall of the authority's own (which sends none) is never the
        worker's silence."""
        return self._pings - line.answered


def _fitted(config: GatewayConfig, workers: int) -> GatewayConfig:
    """The configuration as ``workers`` workers take it: each share of the body budget holds
    the largest body (`fit_workers`; ``serve`` refused a configuration that set it too small)."""
    return config.model_copy(update={"limits": fit_workers(config.limits, workers)})
