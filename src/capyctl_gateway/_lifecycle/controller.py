"""The state of every launched deployment, and what moves it.

A request for a launched deployment first calls `Lifecycle.want`: an operator's stop (or
``activation: explicit``) refuses it at once; a deployment that does not serve now gets its
activation under way. The request then waits in the deployment's queue, whose gate is open
exactly while the deployment serves (`DeploymentLife.regate`): waiting, it holds no running
slot, so a drain waits only for requests that really run. One activation serves a wave of
waiting requests; it runs as a task of its own so that a waiter who leaves does not cancel it;
when it fails, every waiter gets its own error.

Every closing (switched out for another deployment, idle, an operator's park or stop) is one
`close`: the gate shuts, running requests finish within ``drain_timeout``, then the deployment
is parked or stopped. A switch or a park whose drain fails does not happen: the deployment
serves on. An operator's stop happens regardless, once the drain is over. Requests that arrived
meanwhile wait and are served by the activation that follows (none follows an operator's stop:
they are refused). A deployment ready and unused for ``ready_idle_timeout`` (counted from the
end of its last request) is closed the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from .._clock import stamp
from .._config import GatewayConfig
from .._deployments.routes import EngineInstance, Route
from .._deployments.settle import Settlement
from .._errors import (
    ActivationFailedError,
    DeploymentStoppedError,
    EngineControlError,
    GatewayError,
    InternalError,
    UnavailableError,
)
from .._scheduling.scheduler import Scheduler
from .._tasks import Supervisor
from . import comeback
from .budget import MemoryBudget
from .crash import backoff_left, exit_watch
from .rest import closing
from .states import REQUESTED, STARTABLE, AbandonedError, DeploymentLife, InstanceState, Launched
from .transitions import Transitions
from .watch import look, reported

__all__ = ["InstanceState", "Launched", "Lifecycle", "fresh"]

logger = logging.getLogger("capyctl_gateway")
TICK_S = 1.0
"""How often idle deployments and exited engines are looked for."""


class Lifecycle:
    """Every launched deployment of one gateway."""

    def __init__(
        self,
        config: GatewayConfig,
        routes: dict[str, Route],
        settlement: Settlement,
        *,
        tasks: Supervisor,
        remember: Callable[[str, bool, bool], None] | None = None,
    ) -> None:
        """``tasks``: the supervisor its activations, closings and watches run in (its owner,
        the fleet, opens and closes it). ``remember(name, stopped, started)`` keeps an
        operator's intent for a deployment across restarts (the store)."""
        self._config = config
        self.tasks = tasks
        self._remember = remember
        self.lives: dict[str, DeploymentLife] = {
            name: DeploymentLife(r, [Launched(i) for i in r.instances if i.launch is not None])
            for name, r in routes.items()
            if r.deployment.launched
        }
        self._launched = {
            lc.inst.key: (life, lc) for life in self.lives.values() for lc in life.launched
        }
        self.scheduler = Scheduler(config)
        self.budget = MemoryBudget(config, self.lives, self._switch_out, self.scheduler)
        self.engines = Transitions(self.lives, settlement, self.budget)
        self.engines.observers += (exit_watch(self), comeback.watch(self), self.scheduler.costs)

    # -- requests ------------------------------------------------------------------------
    def want(self, name: str) -> None:
        """A request for deployment ``name`` arrived: refuse it now if it may not start the
        deployment, else see that an activation is under way unless it serves now.

        Raises:
            DeploymentStoppedError: an operator stopped it, or it starts only when told to
                (``activation: explicit``).
        """
        life = self.lives.get(name)
        if life is None or life.route.queue.open:
            return
        refused = life.refusal()
        if refused is not None:
            raise refused
        self.activate(life, REQUESTED)

    def activate(self, life: DeploymentLife, why: str) -> asyncio.Task[None]:
        """The deployment's activation (the one running, or a new one started for ``why``:
        who asked, as its transitions' reason; `REQUESTED` for requests)."""
        if life.wanted(why) or life.activation is None:
            what = f"activating deployment {life.deployment.name}"
            life.activation = self.tasks.spawn(
                self._activate(life, why), kind="activation", what=what
            )
        return life.activation

    async def _activate(self, life: DeploymentLife, why: str) -> None:
        """One activation of ``life``: after any closing under way, room reserved in the memory
        budget, then every instance that can be started started and every parked one woken; it
        failed if none became ready, and then every request waiting for it gets its own error."""
        try:
            if life.closing is not None:
                await asyncio.shield(life.closing)
            if life.ready:
                return  # a closing that failed: it serves on
            await life.starts.again_while_abandoned(lambda: self._bring_up(life, why))
        except GatewayError as exc:
            _refuse_waiters(life, exc)
            raise
        except Exception as exc:  # a defect: logged once, and every waiter answered now
            what = f"activating deployment {life.deployment.name}"
            failure = self.tasks.fault("activation", what, exc)
            _refuse_waiters(life, failure)
            raise failure from exc

    async def _bring_up(self, life: DeploymentLife, why: str) -> None:
        name = life.deployment.name
        stops = [lc.stopping for lc in life.launched if lc.stopping is not None]
        stops += [life.spare] if life.spare is not None else []  # a spare's (its fault its own)
        await asyncio.gather(*map(asyncio.shield, stops), return_exceptions=True)  # a crash's stop
        todo = _startable(life)
        parked = [lc for lc in life.launched if lc.state is InstanceState.PARKED]
        if not await self.budget.make_room(life, todo, parked):
            return  # no request waits for it any more
        try:
            await _backoff(life, todo)
        except (GatewayError, AbandonedError) as exc:  # reserved is free again; undone: again
            for lc in [*todo, *parked]:
                self.budget.note(lc)
            refused = life.refusal()
            if isinstance(exc, GatewayError) or refused is None:
                raise
            raise refused from None
        engines = self.engines
        jobs = [*(engines.start(lc, why) for lc in todo), *(engines.wake(lc, why) for lc in parked)]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for r in results:  # a defect in one start is raised, never read as a failed start
            if isinstance(r, Exception) and not isinstance(r, EngineControlError | GatewayError):
                raise r
        if not life.ready:
            refused = life.refusal()
            if refused is not None:  # an operator's stop abandoned the start
                raise refused
            raise _failed(name, results)

    # -- closing ------------------------------------------------------------------------------
    def close(
        self,
        life: DeploymentLife,
        reason: str,
        *,
        may_park: bool = True,
        must: bool = False,
        unless: Callable[[], str | None] | None = None,
    ) -> asyncio.Task[bool]:
        """Close ``life`` for ``reason`` (see the module's docstring); the task that does it,
        whose result says whether it came to rest. ``must``: stop or park even when running
        requests outlast the drain (an operator's stop); else the closing fails and it serves
        on. ``unless``: asked once the drain is over, why the closing is no longer wanted (it
        then serves on); None while it is. A closing already under way is the one returned."""
        if life.closing is None:
            what = f"closing deployment {life.deployment.name} ({reason})"
            task = closing(self, life, reason, may_park, must, unless)
            life.closing = self.tasks.spawn(task, kind="closing", what=what)
            life.regate(reason)
        return life.closing

    def _switch_out(self, life: DeploymentLife, target: DeploymentLife) -> asyncio.Task[bool]:
        name = target.deployment.name
        why = f"switched out for deployment {name} (the memory budget)"

        def unwanted() -> str | None:  # an operator stopped the deployment it made room for
            if target.refusal() is None:
                return None
            return f"deployment {name}, which it made room for, may no longer start"

        return comeback.switched_out(life, self.close(life, why, unless=unwanted))

    # -- time -------------------------------------------------------------------------------
    def watch(self) -> asyncio.Task[None]:
        """Look for idle deployments and engines that exited, every `TICK_S`, for as long as
        its supervisor is open (a look that faults is logged, and the watch goes on)."""

        async def step() -> None:
            await look(self, stamp())

        return self.tasks.keep(step, every=TICK_S, kind="idle_watch", what="the idle watch")

    def remember(self, life: DeploymentLife) -> None:
        """Keep an operator's intent for ``life`` across the gateway's restarts."""
        if self._remember is not None:
            self._remember(life.deployment.name, life.operator_stopped, life.operator_started)

    async def shutdown(self) -> None:
        """End every task it runs, then stop every engine this process started."""
        await self.tasks.aclose()
        # Engines on hosts keep running: a server that comes back finds them as they were.
        await asyncio.gather(
            *(
                self.engines.stop_one(lc, "the gateway is stopping")
                for life in self.lives.values()
                for lc in life.launched
                if not lc.inst.runner.site.outlives_gateway
            )
        )

    # -- what hosts report ------------------------------------------------------------------
    def found(self, inst: EngineInstance, state: str, failure: str | None) -> None:
        """What a host reports of a launched instance's engine (``state``: a lifecycle state;
        ``failure``: why it stopped there): see `watch.reported`."""
        entry = self._launched.get(inst.key)
        if entry is not None:
            reported(self, *entry, state, failure)


async def _backoff(life: DeploymentLife, todo: list[Launched]) -> None:
    """Before ``life``'s starts (room reserved): refused if an operator stopped it while it
    waited for room; the crash backoff, if it kept crashing (an operator's stop abandons it:
    AbandonedError)."""
    refused = life.refusal()
    if refused is not None:
        raise refused
    wait = max((backoff_left(lc, stamp()) for lc in todo), default=0.0)
    if wait > 0:  # status shows how long
        name = life.deployment.name
        logger.warning("deployment %s crashed again; starting it in %.1f s", name, wait)
        async with life.starts.abandonable():
            await asyncio.sleep(wait)


def _startable(life: DeploymentLife) -> list[Launched]:
    """The instances an activation of ``life`` starts: those stopped or failed whose runner can
    start them now. Raises UnavailableError (retryable) when some are stopped or failed, none
    of them can start and none is parked: nothing is switched out for a start that cannot
    begin (its cluster's API unreachable)."""
    todo = [lc for lc in life.launched if lc.state in STARTABLE]
    blocked = [(lc, why) for lc in todo if (why := lc.inst.runner.cannot_start()) is not None]
    parked = any(lc.state is InstanceState.PARKED for lc in life.launched)
    if blocked and len(blocked) == len(todo) and not parked:
        why = blocked[0][1]
        raise UnavailableError(f"deployment {life.deployment.name} cannot be started now: {why}")
    return [lc for lc in todo if all(lc is not b for b, _ in blocked)]


def _failed(name: str, results: Sequence[object]) -> GatewayError | AbandonedError:
    """What the activation of deployment ``name`` failed with: each start's failure in
    ``results``. Where no engine ran (a pod the cluster refused or could not be asked for),
    its reason is the message; else the engine's last words are in the log. A start that an
    operator's stop abandoned, where no stop holds now (a start came since): AbandonedError."""
    if any(isinstance(r, DeploymentStoppedError) for r in results):
        return AbandonedError()  # `Starts.again_while_abandoned` starts it again
    failures = [r for r in results if isinstance(r, EngineControlError)]
    first = failures[0] if failures else None
    detail = first.message if first is not None else "no instance became ready"
    if first is not None and not any(f.began for f in failures):
        return ActivationFailedError(
            f"deployment {name} could not be started: {first.message}", detail=detail
        )
    return ActivationFailedError(
        f"deployment {name} could not be started; the gateway's log has the engine's last words",
        detail=detail,
    )


def _refuse_waiters(life: DeploymentLife, failure: GatewayError) -> None:
    refused = life.route.queue.fail_waiters(lambda: fresh(failure))
    logger.info(
        "deployment %s: %d waiting requests refused: %s",
        life.deployment.name,
        refused,
        failure.message,
    )


def fresh(exc: GatewayError) -> GatewayError:
    """A copy of ``exc`` for one waiter (errors are never shared between requests)."""
    if isinstance(exc, ActivationFailedError):
        return ActivationFailedError(exc.message, detail=exc.detail)
    if isinstance(exc, DeploymentStoppedError):
        return DeploymentStoppedError(exc.message, code=exc.code)
    if isinstance(exc, InternalError):
        return InternalError(exc.message)
    return UnavailableError(exc.message, detail=exc.detail)
