"""What an operator asks of a launched deployment (management API and CLI): start, stop, park,
and the list of every deployment with its state and memory."""

from __future__ import annotations

import asyncio
from typing import Any

from .._clock import stamp
from .._deployments.routes import EngineInstance
from .._errors import (
    ActivationFailedError,
    DeploymentStoppedError,
    GatewayError,
    UnavailableError,
    UnknownModelError,
)
from .controller import Lifecycle, fresh
from .rest import quiesce
from .states import DeploymentLife, InstanceState

__all__ = [
    "deployments_list",
    "operator_park",
    "operator_start",
    "pool_schedule",
    "operator_stop",
    "seen_ready",
]


def _life(lifecycle: Lifecycle, name: str, known: bool) -> DeploymentLife:
    life = lifecycle.lives.get(name)
    if life is not None:
        return life
    if known:
        raise GatewayError(
            f"deployment {name} is an engine someone else runs (url:); the gateway cannot "
            "start, stop or park it",
            status=409,
            code="deployment_not_launched",
        )
    raise UnknownModelError(f"no deployment named {name!r}")


async def operator_start(lifecycle: Lifecycle, name: str, *, known: bool) -> None:
    """Start it (and let requests start it again); waits until it is ready or failed. An
    operator's stop that comes while it starts abandons the start: 409 ``deployment_stopped``."""
    life = _life(lifecycle, name, known)
    life.operator_stopped = False
    life.operator_started = True
    lifecycle.remember(life)
    while not life.serves_now:
        if life.closing is not None:
            await asyncio.gather(asyncio.shield(life.closing), return_exceptions=True)
            continue
        try:
            await asyncio.shield(lifecycle.activate(life, "started by an operator"))
        except (ActivationFailedError, UnavailableError, DeploymentStoppedError) as exc:
            raise fresh(exc) from None  # a stop that came after it: the operator's last word


async def operator_stop(lifecycle: Lifecycle, name: str, *, known: bool) -> None:
    """Stop it and keep it stopped: requests get 409 deployment_stopped until a start, those
    waiting for it at once. A start under way is abandoned (its engine stopped at once). Its
    running requests finish within drain_timeout first; what still runs then is cut (each such
    stream ends with an in-band error)."""
    life = _life(lifecycle, name, known)
    life.operator_stopped = True
    life.operator_started = False
    lifecycle.remember(life)
    refusal = life.refusal()  # deployment_stopped
    if refusal is not None:
        life.route.queue.fail_waiters(lambda: fresh(refusal))
    life.starts.abandon()  # a start under way ends now (a pod that waits for a node)
    await quiesce(life)
    if life.operator_stopped:  # not started again meanwhile
        await lifecycle.close(life, "stopped by an operator", may_park=False, must=True)


async def operator_park(lifecycle: Lifecycle, name: str, *, known: bool) -> None:
    """Park it (a stop where it cannot park); the next request wakes or starts it again, and
    requests that arrive meanwhile wait for that. A park whose running requests do not finish
    within drain_timeout does not happen (409 ``park_refused``): it serves on."""
    life = _life(lifecycle, name, known)
    await quiesce(life)
    if not await lifecycle.close(life, "parked by an operator", may_park=True):
        raise GatewayError(
            f"deployment {name} was not parked: its running requests did not finish within "
            "lifecycle.drain_timeout; it serves on",
            status=409,
            code="park_refused",
        )


def seen_ready(inst: EngineInstance) -> bool:
    """Whether what watches the instance's engine (the collector here, the host's reports
    there) says it is ready: the judgement ``status`` shows. An engine someone else runs is
    always admitting, so this alone says whether it can answer."""
    return inst.runner.describe().watched == "ready"


def deployments_list(
    lifecycle: Lifecycle, routes: dict[str, Any], budget: int | None
) -> dict[str, Any]:
    """Every deployment: how it is run, its state, its instances and the memory it holds; and
    each memory pool: what it holds of the budget (which every pool has whole), each
    deployment's share, which are resident, which wait and since when, and the switch the
    scheduler means to make next (`pool_schedule`)."""
    rows = []
    for name, route in routes.items():
        d = route.deployment
        life = lifecycle.lives.get(name)
        row: dict[str, Any] = {
            "name": name,
            "id": route.id,
            "api": d.api.value,
            "engine": d.engine.value,
            "instances": len(route.instances),
            "ready": sum(1 for i in route.instances if i.available and not i.unusable),
        }
        if life is None:  # always admitting: ready is what watches it says, as in ``status``
            row["ready"] = sum(1 for i in route.instances if seen_ready(i) and not i.unusable)
            row["run_by"] = "someone else (url)"
            row["state"] = "ready" if row["ready"] else "unavailable"
        else:
            row["run_by"] = route.instances[0].runner.site.run_by
            row["state"] = life.state
            placed = [(i.index, i.runner.describe().placed) for i in route.instances]
            if any(where for _, where in placed):  # where each runs now, when its runner says
                row["placed"] = [{"instance": n, "where": w} for n, w in placed if w]
            if life.operator_stopped:  # while its stop is under way, the state it is in
                row["state"] = (
                    "stopped by an operator"
                    if life.state in ("stopped", "failed")
                    else f"{life.state} (an operator's stop)"
                )
            if d.memory is not None:
                row["memory_held"] = lifecycle.budget.held_by(life)
        rows.append(row)
    held = lifecycle.budget.held()
    pools = []
    for pool, shares in lifecycle.budget.shares().items():
        row = {
            "pool": pool,
            "held": sum(shares.values()),
            "budget": budget,
            "deployments": [{"name": n, "held": h} for n, h in shares.items()],
        }
        if budget is not None and row["held"] > budget:  # only an unconfirmed stop does this
            row["over_budget"] = True
        row.update(pool_schedule(lifecycle, pool))
        row["history"] = lifecycle.budget.history.rows(pool)
        pools.append(row)
    doc: dict[str, Any] = {"deployments": rows, "memory_budget": budget, "memory_held": held}
    if any("over_budget" in p for p in pools):  # each pool has the whole budget
        doc["over_budget"] = True
    doc["pools"] = pools
    return doc


def pool_schedule(lifecycle: Lifecycle, pool: str) -> dict[str, Any]:
    """What ``list`` shows of the scheduler in ``pool``: the deployments resident there (an
    engine ready or parked), those whose requests wait to be switched in (how many, the oldest's
    wait), and the switch it means to make next and why (absent while none is meant)."""
    now = stamp()
    resident, waiting = [], []
    for name, life in lifecycle.lives.items():
        if not any(lc.inst.runner.site.pool == pool for lc in life.launched):
            continue
        up = [lc for lc in life.launched if lc.state in (InstanceState.READY, InstanceState.PARKED)]
        if up:
            resident.append(name)
        queue = life.route.queue
        if queue.waiting and not life.serves_now and queue.oldest is not None:
            waiting.append(
                {"name": name, "requests": queue.waiting, "oldest_s": round(now - queue.oldest, 1)}
            )
    row: dict[str, Any] = {"resident": resident, "waiting": waiting}
    intent = lifecycle.scheduler.intents.get(pool)
    if intent is not None:
        row["next_switch"] = intent.row(now)
    return row
