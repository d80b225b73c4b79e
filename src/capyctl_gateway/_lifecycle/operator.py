"""What an operator asks of a launched deployment (management API and CLI): start, stop, park,
and the list of every deployment with its state and memory."""

from __future__ import annotations

import asyncio
from typing import Any

from .._errors import (
    ActivationFailedError,
    GatewayError,
    UnavailableError,
    UnknownModelError,
)
from .controller import Lifecycle, fresh
from .rest import put_to_rest
from .states import HOLDING, DeploymentLife, InstanceState

__all__ = ["deployments_list", "operator_park", "operator_start", "operator_stop"]


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
    """Start it (and let requests start it again); waits until it is ready or failed."""
    life = _life(lifecycle, name, known)
    life.operator_stopped = False
    life.operator_started = True
    lifecycle.remember(life)
    if life.closing is not None:
        await asyncio.shield(life.closing)
    if not life.ready:
        try:
            await asyncio.shield(lifecycle.activate(life))
        except (ActivationFailedError, UnavailableError) as exc:
            raise fresh(exc) from None


async def operator_stop(lifecycle: Lifecycle, name: str, *, known: bool) -> None:
    """Stop it and keep it stopped: requests get 409 deployment_stopped until a start. Its
    running requests finish within drain_timeout first."""
    life = _life(lifecycle, name, known)
    life.operator_stopped = True
    life.operator_started = False
    lifecycle.remember(life)
    await _drain_and_rest(lifecycle, life, "stopped by an operator", may_park=False)


async def operator_park(lifecycle: Lifecycle, name: str, *, known: bool) -> None:
    """Park it (a stop where it cannot park); the next request wakes or starts it again."""
    life = _life(lifecycle, name, known)
    await _drain_and_rest(lifecycle, life, "parked by an operator", may_park=True)


async def _drain_and_rest(
    lifecycle: Lifecycle, life: DeploymentLife, reason: str, *, may_park: bool
) -> None:
    life.draining = True
    try:
        for lc in life.launched:
            lc.inst.set_open(admitting=False, why=reason)
        if life.activation is not None and not life.activation.done():
            await asyncio.gather(asyncio.shield(life.activation), return_exceptions=True)
        await life.route.queue.drained(life.deployment.lifecycle.drain_timeout)
        await put_to_rest(lifecycle.engines, life, reason, may_park=may_park)
    finally:
        life.draining = False


def deployments_list(
    lifecycle: Lifecycle, routes: dict[str, Any], budget: int | None
) -> dict[str, Any]:
    """Every deployment: how it is run, its state, its instances and the memory it holds."""
    rows = []
    for name, route in routes.items():
        d = route.deployment
        life = lifecycle.lives.get(name)
        row: dict[str, Any] = {
            "name": name,
            "api": d.api.value,
            "engine": d.engine.value,
            "instances": len(route.instances),
            "ready": sum(1 for i in route.instances if i.available and not i.unusable),
        }
        if life is None:
            row["run_by"] = "someone else (url)"
            row["state"] = "ready" if row["ready"] else "unavailable"
        else:
            row["run_by"] = "the gateway (launch)"
            row["state"] = "stopped by an operator" if life.operator_stopped else life.state
            if d.memory is not None:
                row["memory_held"] = sum(
                    d.memory.ready if lc.state in HOLDING else d.memory.parked
                    for lc in life.launched
                    if lc.state in HOLDING or lc.state is InstanceState.PARKED
                )
        rows.append(row)
    return {
        "deployments": rows,
        "memory_budget": budget,
        "memory_held": lifecycle.budget.held(),
    }
