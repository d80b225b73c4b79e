"""Closing a deployment and putting it to rest: parked with its process up where ``park:
sleep`` allows it, stopped otherwise.

A cut request that waits for "the engine's next stop or restart" (it was cut before the
engine's first token, so the engine may still run it) would never be settled by a park: an
instance that counts one stops instead, which settles it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._clock import stamp
from .._deployments.settle import SettleRule
from .states import REQUESTED, DeploymentLife, InstanceState, Launched
from .transitions import Transitions

if TYPE_CHECKING:
    from .controller import Lifecycle

__all__ = ["closing", "put_to_rest", "quiesce", "waits_for_restart"]

logger = logging.getLogger("capyctl_gateway")


def waits_for_restart(lc: Launched) -> bool:
    return any(c.rule is SettleRule.AT_RESTART for c in lc.inst.ledger.cut)


async def put_to_rest(
    engines: Transitions, life: DeploymentLife, reason: str, *, may_park: bool = True
) -> None:
    """Park each ready instance where it can be parked, stop the others (and, without
    ``may_park``, parked ones too)."""
    jobs = []
    for lc in life.launched:
        lc.rested = False  # the whole deployment rests: no spare apart (`status` says so)
        if lc.state is InstanceState.PARKED and may_park:
            continue  # at rest already
        if lc.state is InstanceState.READY and life.parks and may_park:
            if waits_for_restart(lc):
                why = f"{reason}; a stop, not a park: cut requests wait for a restart"
                jobs.append(engines.stop_one(lc, why))
            else:
                jobs.append(engines.park(lc, reason))
        else:
            jobs.append(engines.stop_one(lc, reason if life.parks else f"{reason} (a stop here)"))
    await asyncio.gather(*jobs)


async def closing(
    lifecycle: Lifecycle,
    life: DeploymentLife,
    reason: str,
    may_park: bool,
    must: bool,
    unless: Callable[[], str | None] | None = None,
) -> bool:
    """`Lifecycle.close`'s task (its gate is shut): the running requests drain within
    ``drain_timeout``, then ``life`` is put to rest; whether it was. Without ``must``, a drain
    that fails ends the closing: it serves on; so does one that ``unless`` says is no longer
    wanted once the drain is over (a switch for a deployment an operator stopped meanwhile).
    Past the drain none of its instances takes a request (`DeploymentLife.resting`): a spare
    woken meanwhile neither. Requests that came meanwhile get an activation."""
    rested = False
    life.route.waiters.notify()  # those waiting for an instance look again (a stop: 409)
    try:
        within = life.deployment.lifecycle.drain_timeout
        began, ran = stamp(), life.route.queue.running
        drained = await life.route.queue.drained(within)
        if ran:  # a closing with nothing to drain says nothing of what a drain costs
            lifecycle.scheduler.costs.drained(life, stamp() - began)
        unwanted = unless() if unless is not None else None
        if unwanted is not None:
            logger.info(
                "deployment %s: not %s: %s; it serves on", life.deployment.name, reason, unwanted
            )
            return False
        if not drained and not must:
            logger.warning(
                "deployment %s: %d requests still ran after lifecycle.drain_timeout (%.0f s): "
                "not %s; it serves on",
                life.deployment.name,
                life.route.queue.running,
                within,
                reason,
            )
            return False
        life.resting = True  # nothing is placed on it from now (a spare that wakes neither)
        for lc in life.launched:
            lc.inst.set_open(admitting=False, why=reason)
        if not drained:  # an operator's stop: what still runs ends now, and hears why
            why = f"deployment {life.deployment.name}: {reason} (past lifecycle.drain_timeout)"
            life.route.abort_running(why, "deployment_stopped")
        if life.spare is not None:  # a spare's park or wake first (its fault is its own)
            await asyncio.wait([life.spare])
        # A second turn for a deployment already parked: parking did not free enough.
        at_rest = all(lc.state is not InstanceState.READY for lc in life.launched)
        await put_to_rest(lifecycle.engines, life, reason, may_park=may_park and not at_rest)
        rested = True
        return True
    except Exception as exc:  # a defect: logged once; who awaits it answers internal_error
        what = f"closing deployment {life.deployment.name} ({reason})"
        raise lifecycle.tasks.fault("closing", what, exc) from exc
    finally:
        if life.resting and not rested:  # a fault past the drain: what is up serves on
            for lc in life.launched:
                if lc.state is InstanceState.READY and not lc.rested:
                    lc.inst.set_open(admitting=True, why="serves on")
        life.closing, life.resting = None, False
        life.regate(f"{reason}: done" if rested else "serves on")
        if life.route.queue.waiting and life.refusal() is None:
            lifecycle.activate(life, REQUESTED)  # it came while it closed


async def quiesce(life: DeploymentLife) -> None:
    """Wait until no activation or closing of ``life`` is under way."""
    while True:
        busy = [t for t in (life.activation, life.closing) if t is not None and not t.done()]
        if not busy:
            return
        await asyncio.gather(*(asyncio.shield(t) for t in busy), return_exceptions=True)
