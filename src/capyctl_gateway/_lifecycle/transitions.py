"""Starting, parking, waking and stopping launched instances through their runners, each
transition logged as a ``lifecycle`` event with the deployment, instance, from, to, reason and
how long the state before lasted.

Where the engine runs is the runner's business (`Runner`: this machine's processes, or a host's
orders); the states, their order and what each means for requests are the same everywhere. A
ready instance admits requests; every other state admits none.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._clock import stamp
from .._deployments.settle import Settlement
from .._errors import DeploymentStoppedError, EngineControlError, StartFailedError
from .._log import event
from .crash import count_failure
from .states import HOLDING, AbandonedError, DeploymentLife, InstanceState, Launched

if TYPE_CHECKING:
    from .budget import MemoryBudget

__all__ = ["Transitions"]

logger = logging.getLogger("capyctl_gateway")


class Transitions:
    def __init__(
        self, lives: dict[str, DeploymentLife], settlement: Settlement, budget: MemoryBudget
    ) -> None:
        self.lives = lives
        self._settlement = settlement
        self._budget = budget
        self.observers: list[Callable[[Launched], None]] = []
        """Called after each transition (telemetry, tests)."""

    async def start(self, lc: Launched, reason: str) -> None:
        """Start one stopped or failed instance; raises EngineControlError if it did not, and
        DeploymentStoppedError if an operator's stop abandoned it (its engine is stopped)."""
        lc.inst.ledger.stopped = None  # what is cut from now on may run on the new engine
        self.move(lc, InstanceState.STARTING, reason)
        runner = lc.inst.runner
        try:
            async with self.lives[lc.inst.deployment].starts.abandonable():
                answered = await runner.start(reason)
        except EngineControlError as exc:
            lc.failure = exc.message
            count_failure(lc, stamp())  # its next start waits
            lc.unconfirmed = lc.unconfirmed or exc.lingers  # its memory stays counted
            self.move(lc, InstanceState.FAILED, exc.message)
            raise
        except BaseException as exc:  # abandoned: an operator's stop, the gateway's shutdown
            by_operator = isinstance(exc, AbandonedError)
            why = "start abandoned" + (": an operator stopped it" if by_operator else "")
            lc.unconfirmed = not await runner.stop(why)
            self.move(lc, InstanceState.STOPPED, why)
            if by_operator:
                raise DeploymentStoppedError(
                    f"deployment {lc.inst.deployment} was stopped by an operator as it started"
                ) from None
            raise
        self._ready(lc, answered)

    async def park(self, lc: Launched, reason: str) -> None:
        """Park with the process up (the engine gives its memory back); a stop if it fails."""
        if lc.state is not InstanceState.READY:
            return
        lc.inst.set_open(admitting=False, why=reason)
        self.move(lc, InstanceState.PARKING, reason)
        try:
            await lc.inst.runner.park(reason)
        except EngineControlError as exc:
            logger.warning("%s did not park (%s); stopping it instead", lc.inst.where, exc)
            await self.stop_one(lc, f"could not park: {exc}")
            return
        self.move(lc, InstanceState.PARKED, _on(lc, reason))

    async def wake(self, lc: Launched, reason: str) -> None:
        """Wake a parked instance; a wake that fails stops it (StartFailedError)."""
        self.move(lc, InstanceState.WAKING, reason)
        try:
            await lc.inst.runner.wake(reason)
        except EngineControlError as exc:
            await self.stop_one(lc, f"could not wake: {exc}")
            lc.failure = f"could not wake: {exc}"
            count_failure(lc, stamp())  # as a failed start: its next try backs off
            self.move(lc, InstanceState.FAILED, lc.failure)
            raise StartFailedError(f"the engine did not wake: {exc}") from None
        self._ready(lc, _on(lc, "woke"))

    def _ready(self, lc: Launched, reason: str) -> None:
        lc.failure, lc.rested = None, False
        self.move(lc, InstanceState.READY, reason)
        if not self.lives[lc.inst.deployment].resting:  # else a closing puts it to rest next
            lc.inst.set_open(admitting=True, why=reason)

    async def stop(self, life: DeploymentLife, reason: str) -> None:
        await asyncio.gather(*(self.stop_one(lc, reason) for lc in life.launched))

    async def stop_one(self, lc: Launched, reason: str) -> None:
        if lc.state not in HOLDING and lc.state is not InstanceState.PARKED:
            return
        inst = lc.inst
        inst.set_open(admitting=False, why=reason)
        self.move(lc, InstanceState.STOPPING, reason)
        try:
            proven = await inst.runner.stop(reason)
        except EngineControlError as exc:  # its cut requests and memory stay counted: unproven
            logger.warning("%s: the stop is not confirmed (%s)", inst.where, exc)
            lc.unconfirmed = True
            self.move(lc, InstanceState.STOPPED, f"{reason}; unconfirmed: {exc}")
            return
        finally:
            inst.unusable = None  # its next process is checked afresh
            lc.stop_over()  # however it ended: an activation waiting for it goes on
        lc.unconfirmed = not proven
        if proven:  # a stopped engine runs nothing: every cut request it counted is settled
            why = f"engine stopped by {inst.runner.site.stopper}"
            self._settlement.settle_all(inst.ledger, why)
            inst.ledger.stopped = why  # and so is one whose end is heard only later
        self.move(lc, InstanceState.STOPPED, reason)

    def found(self, lc: Launched, state: InstanceState, reason: str) -> None:
        """Take up an engine found running (or parked) without this gateway starting it."""
        lc.failure = None
        lc.inst.ledger.stopped = None
        if state is InstanceState.READY:
            self._ready(lc, reason)
        else:
            self.move(lc, state, reason)

    def move(self, lc: Launched, to: InstanceState, reason: str) -> None:
        now = stamp()
        before, took = lc.state, now - lc.since
        lc.enter(to, now)
        self._budget.note(lc)
        inst = lc.inst
        _said(lc, before, reason, took)
        life = self.lives.get(inst.deployment)
        if life is not None:
            life.regate(f"instance {inst.index} {to.value}")
        for observe in self.observers:
            observe(lc)


def _said(lc: Launched, before: InstanceState, reason: str, took: float) -> None:
    """Log ``lc``'s transition from ``before`` as a ``lifecycle`` event."""
    inst, to = lc.inst, lc.state
    event(
        "lifecycle",
        "%s: %s -> %s (%s; %.1f s %s)",
        inst.where,
        before.value,
        to.value,
        reason,
        took,
        before.value,
        deployment=inst.deployment,
        instance=inst.index,
        **{"from": before.value},
        to=to.value,
        reason=reason,
        duration_s=round(took, 3),
    )


def _on(lc: Launched, reason: str) -> str:
    return lc.inst.runner.site.said(reason)
