"""The state of every launched deployment, and the transitions between states.

A request for a launched deployment calls `Lifecycle.ensure_ready` once it has a queue slot:
when no instance is ready, it joins the deployment's activation (one per wave of waiting
requests, run as a task of its own so that a waiter who leaves does not cancel it) and waits
for it within the request's deadline. An activation that would pass the memory budget first
switches out idle deployments (longest unused first; never one with waiting requests), letting
their running requests finish within ``drain_timeout``. A deployment ready and unused for
``ready_idle_timeout`` is stopped (a park is a stop for the engines this gateway can run on
this platform). Stopping an engine settles every cut request still counted against it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from .._config import GatewayConfig
from .._deployments.routes import EngineInstance, Route
from .._deployments.settle import Settlement
from .._errors import (
    ActivationFailedError,
    DeploymentStoppedError,
    EngineControlError,
    GatewayError,
    UnavailableError,
)
from .budget import MemoryBudget
from .rest import drain_and_rest, rest_for
from .states import STARTABLE, DeploymentLife, InstanceState, Launched
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
        remember: Callable[[str, bool, bool], None] | None = None,
    ) -> None:
        """``remember(name, stopped, started)`` keeps an operator's intent for a deployment
        across restarts (the store)."""
        self._config = config
        self._remember = remember
        self.lives: dict[str, DeploymentLife] = {
            name: DeploymentLife(r, [Launched(i) for i in r.instances if i.launch is not None])
            for name, r in routes.items()
            if r.deployment.launched
        }
        self._launched = {
            lc.inst.key: (life, lc) for life in self.lives.values() for lc in life.launched
        }
        self._tasks: set[asyncio.Task[None]] = set()
        self.budget = MemoryBudget(config, self.lives, self._switch_out)
        self.engines = Transitions(self.lives, settlement)

    # -- requests ------------------------------------------------------------------------
    async def ensure_ready(self, name: str, deadline: float) -> None:
        """Return once deployment ``name`` has a ready instance, starting it if it must.

        Raises:
            DeploymentStoppedError: it starts only when told to (``activation: explicit``).
            ActivationFailedError: the start failed (the next request tries again).
            UnavailableError: not ready by ``deadline`` (loop time), or no room in the budget.
        """
        life = self.lives.get(name)
        if life is None:
            return
        life.last_used = time.monotonic()
        if life.ready and life.closing is None:
            return
        refused = _refusal(life, name)
        if refused is not None:
            raise refused
        loop = asyncio.get_running_loop()
        if life.closing is not None:  # being switched out: it comes back after
            await _within(asyncio.shield(life.closing), deadline, name)
        try:
            await _within(asyncio.shield(self.activate(life)), deadline, name)
        except (ActivationFailedError, UnavailableError) as exc:
            raise fresh(exc) from None  # each waiter its own error, never the task's one
        life.last_used = time.monotonic()
        if loop.time() > deadline:
            raise UnavailableError(f"deployment {name} was not ready within queue.request_deadline")

    # -- time -------------------------------------------------------------------------------
    async def run(self) -> None:
        """Look for idle deployments and engines that exited, every `TICK_S`."""
        while True:
            await asyncio.sleep(TICK_S)
            await look(self, time.monotonic())

    def remember(self, life: DeploymentLife) -> None:
        """Keep an operator's intent for ``life`` across the gateway's restarts."""
        if self._remember is not None:
            self._remember(life.deployment.name, life.operator_stopped, life.operator_started)

    def activate(self, life: DeploymentLife) -> asyncio.Task[None]:
        """The deployment's activation (the one running, or a new one)."""
        if life.activation is None or life.activation.done():
            life.activation = self._spawn(_activate(self, life))
        return life.activation

    def _switch_out(self, life: DeploymentLife) -> asyncio.Task[None]:
        """Start switching ``life`` out (once); the task that does it."""
        if life.closing is None:
            life.closing = self._spawn(drain_and_rest(self.engines, life))
        return life.closing

    def rest(self, life: DeploymentLife, reason: str, *, may_park: bool = True) -> None:
        """Put ``life`` to rest in the background (the idle watch's doing)."""
        if life.closing is None:
            life.closing = self._spawn(rest_for(self, life, reason, may_park))

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Engines on hosts keep running: a server that comes back finds them as they were.
        await asyncio.gather(
            *(
                self.engines.stop_one(lc, "the gateway is stopping")
                for life in self.lives.values()
                for lc in life.launched
                if not lc.inst.runner.outlives_gateway
            )
        )

    # -- what hosts report ------------------------------------------------------------------
    def found(self, inst: EngineInstance, state: str, failure: str | None) -> None:
        """What a host reports of a launched instance's engine (``state``: a lifecycle state;
        ``failure``: why it stopped there): see `watch.reported`."""
        entry = self._launched.get(inst.key)
        if entry is not None:
            reported(self, *entry, state, failure)

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_retrieve)  # its waiters may all have left
        return task


def _refusal(life: DeploymentLife, name: str) -> DeploymentStoppedError | None:
    """Why a request may not start ``life`` (deployment ``name``): an operator stopped it, or it
    starts only when an operator starts it (``activation: explicit``); None when it may."""
    if life.operator_stopped:
        return DeploymentStoppedError(
            f"deployment {name} was stopped by an operator; "
            f"`capyctl-gateway start {name}` starts it again"
        )
    if life.deployment.lifecycle.activation == "explicit" and not life.operator_started:
        return DeploymentStoppedError(
            f"deployment {name} starts only when an operator starts it "
            "(lifecycle.activation: explicit)",
            code="deployment_inactive",
        )
    return None


async def _activate(lifecycle: Lifecycle, life: DeploymentLife) -> None:
    """One activation of ``life``: room made in the memory budget, then every instance that
    can be started started and every parked one woken; it failed if none became ready."""
    name = life.deployment.name
    todo = [lc for lc in life.launched if lc.state in STARTABLE]
    parked = [lc for lc in life.launched if lc.state is InstanceState.PARKED]
    await lifecycle.budget.make_room(life, todo, parked)
    engines = lifecycle.engines
    jobs = [*(engines.start(lc) for lc in todo), *(engines.wake(lc) for lc in parked)]
    results = await asyncio.gather(*jobs, return_exceptions=True)
    if not life.ready:
        failed = next((r for r in results if isinstance(r, EngineControlError)), None)
        detail = failed.message if failed is not None else "no instance became ready"
        raise ActivationFailedError(
            f"deployment {name} could not be started; the gateway's log has the engine's "
            "last words",
            detail=detail,
        )


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


def fresh(exc: GatewayError) -> GatewayError:
    if isinstance(exc, ActivationFailedError):
        return ActivationFailedError(exc.message, detail=exc.detail)
    return UnavailableError(exc.message, detail=exc.detail)


async def _within(waiting: asyncio.Future[None], deadline: float, name: str) -> None:
    timeout = deadline - asyncio.get_running_loop().time()
    try:
        await asyncio.wait_for(waiting, timeout=max(timeout, 0))
    except TimeoutError:
        raise UnavailableError(
            f"deployment {name} was not ready within queue.request_deadline; it goes on starting"
        ) from None
