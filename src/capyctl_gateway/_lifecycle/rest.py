"""Putting a deployment to rest: parked with its process up where ``park: sleep`` allows it,
stopped otherwise.

A cut request that waits for "the engine's next stop or restart" (it was cut before the
engine's first token, so the engine may still run it) would never be settled by a park: an
instance that counts one stops instead, which settles it.
"""

from __future__ import annotations

import asyncio

from .._deployments.settle import SettleRule
from .states import DeploymentLife, InstanceState, Launched
from .transitions import Transitions

__all__ = ["put_to_rest", "waits_for_restart"]


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
