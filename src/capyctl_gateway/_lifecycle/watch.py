"""What the gateway looks for once a second: engines that exited or stopped answering their
polls for ``unresponsive_timeout``, deployments idle for their
``ready_idle_timeout`` (parked or stopped) and parked ones idle for ``parked_idle_timeout``
(stopped); and what hosts report of the engines they run (`reported`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .crash import lost
from .spares import rest_idle
from .states import STARTABLE, DeploymentLife, InstanceState, Launched

if TYPE_CHECKING:
    from .controller import Lifecycle

__all__ = ["boot", "look", "reported"]


def boot(lifecycle: Lifecycle) -> None:
    """At the gateway's start: start what is kept ready (``activation: always``) and what an
    operator had started before the restart (and did not stop since)."""
    for life in lifecycle.lives.values():
        if life.refusal() is not None:
            continue
        if life.deployment.lifecycle.activation == "always":
            lifecycle.activate(life, "kept ready (lifecycle.activation: always)")
        elif life.operator_started:
            lifecycle.activate(life, "an operator had started it before the gateway restarted")


def _idle_for(life: DeploymentLife, now: float) -> float | None:
    """How long ``life`` has been idle: since its last request ended, or since it became
    ready or parked if that came later; None while a request runs or waits, or while it is
    being activated or closed."""
    since = life.idle_since
    if since is None or life.closing is not None or life.activating:
        return None
    return now - max([since, *(lc.since for lc in life.launched if not lc.rested)])


async def look(lifecycle: Lifecycle, now: float) -> None:
    for life in lifecycle.lives.values():
        for lc in life.launched:
            running = lc.state in (InstanceState.READY, InstanceState.PARKED)
            gone = lc.inst.runner.exited() if running else None
            if gone is not None:  # its exit watch has not seen it yet
                await lost(lifecycle, life, lc, gone)
                continue
            silent = lc.inst.runner.silent_s() if lc.state is InstanceState.READY else None
            limit = life.deployment.lifecycle.unresponsive_timeout
            if silent is not None and silent >= limit:  # frozen, or lost in a loop
                why = f"the engine answered nothing for {silent:.0f} s (unresponsive_timeout)"
                await lost(lifecycle, life, lc, why)
        rest_idle(lifecycle, life, now)  # a spare idle while another serves
        cycle = life.deployment.lifecycle
        if cycle.activation == "always":
            quiet = life.closing is None and not life.activating and not life.ready
            if quiet and life.refusal() is None:  # kept ready: after a failure, its backoff
                lifecycle.activate(life, "kept ready (lifecycle.activation: always)")
            continue
        idle_for = _idle_for(life, now)
        if idle_for is None:
            continue
        if life.ready and cycle.ready_idle_timeout is not None:
            if idle_for >= cycle.ready_idle_timeout:
                if life.operator_started:  # an explicit deployment waits to be started again
                    life.operator_started = False
                    lifecycle.remember(life)
                lifecycle.close(life, "idle for lifecycle.ready_idle_timeout")
        elif (
            cycle.parked_idle_timeout is not None
            and life.launched
            and all(lc.state is InstanceState.PARKED for lc in life.launched)
            and idle_for >= cycle.parked_idle_timeout
        ):
            lifecycle.close(life, "parked for lifecycle.parked_idle_timeout", may_park=False)


def reported(
    lifecycle: Lifecycle, life: DeploymentLife, lc: Launched, state: str, failure: str | None
) -> None:
    """Keep a launched instance's state true to what its host reports of it: an engine that
    exited there is failed here (its next request starts it again); one found running or
    parked there (a server that restarted, an answer lost with a session) is taken up as such,
    and stopped if an operator stopped its deployment."""
    inst, engines = lc.inst, lifecycle.engines
    where = inst.runner.site.on
    if lc.state in (InstanceState.READY, InstanceState.PARKED):
        if state in ("stopped", "failed"):
            lc.failure = failure or f"the engine exited {where}"
            engines.move(lc, InstanceState.FAILED, lc.failure)
            inst.set_open(admitting=False, why=lc.failure)
        return
    if lc.unconfirmed and state in ("stopped", "failed"):
        lc.unconfirmed = False  # its host says the engine is gone: its memory is free
        lifecycle.budget.note(lc)
    busy = life.closing is not None or life.activating
    if busy or lc.state not in STARTABLE or state not in ("ready", "parked"):
        return
    seen = InstanceState.READY if state == "ready" else InstanceState.PARKED
    engines.found(lc, seen, f"found {state} {where}")
    if life.operator_stopped:
        lifecycle.close(life, "stopped by an operator", may_park=False, must=True)
