"""Putting a deployment to rest: parked with its process up where ``park: sleep`` allows it,
stopped otherwise.

A cut request that waits for "the engine's next stop or restart" (it was cut before the
engine's first token, so the engine may still run it) would never be settled by a park: an
instance that counts one stops instead, which settles it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from .._deployments.settle import SettleRule
from .states import DeploymentLife, InstanceState, Launched
from .transitions import Transitions

if TYPE_CHECKING:
    from .controller import Lifecycle

__all__ = ["drain_and_rest", "put_to_rest", "rest_for", "waits_for_restart"]


def waits_for_restart(lc: Launched) -> bool:
    return any(c.rule is SettleRule.AT_RESTART for c in lc.inst.ledger.cut)


async def put_to_rest(
    engines: Transitions, life: DeploymentLife, reason: str, *, may_park: bool = True
) -> None:
    """Park each ready instance where it can be parked, stop the others (and, without
    ``may_park``, parked ones too)."""
    jobs = []
    for lc in life.launched:
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


async def rest_for(lifecycle: Lifecycle, life: DeploymentLife, reason: str, may_park: bool) -> None:
    """`Lifecycle.rest`'s task: ``life`` put to rest for ``reason`` (an explicit deployment that
    an operator started waits to be started again); it is no longer closing once done."""
    if life.operator_started:
        life.operator_started = False  # an explicit deployment waits to be started again
        lifecycle.remember(life)
    try:
        await put_to_rest(lifecycle.engines, life, reason, may_park=may_park)
    finally:
        life.closing = None


async def drain_and_rest(engines: Transitions, life: DeploymentLife) -> None:
    """Switching ``life`` out for another deployment: it admits no new request, its running
    ones finish within its ``drain_timeout``, then it is put to rest (stopped, when it was at
    rest already); it is no longer closing once done."""
    try:
        for lc in life.launched:  # requests that arrive wait for it to come back
            lc.inst.set_open(admitting=False, why="switching out for another deployment")
        # Running requests finish on their own, within the drain timeout.
        await life.route.queue.drained(life.deployment.lifecycle.drain_timeout)
        # A second turn for a deployment already parked: parking did not free enough.
        at_rest = all(lc.state is not InstanceState.READY for lc in life.launched)
        why = "switched out for another deployment"
        await put_to_rest(engines, life, why, may_park=not at_rest)
    finally:
        life.closing = None
