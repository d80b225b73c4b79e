"""What the gateway looks for once a second: engines that exited, deployments idle for their
``ready_idle_timeout`` (parked or stopped) and parked ones idle for ``parked_idle_timeout``
(stopped)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .states import DeploymentLife, InstanceState

if TYPE_CHECKING:
    from .controller import Lifecycle

__all__ = ["look"]


def _quiet(life: DeploymentLife) -> bool:
    queue = life.route.queue
    return (
        life.closing is None
        and (life.activation is None or life.activation.done())
        and queue.running == 0
        and queue.waiting == 0
    )


async def look(lifecycle: Lifecycle, now: float) -> None:
    engines = lifecycle.engines
    for life in lifecycle.lives.values():
        for lc in life.launched:
            proc = lc.process
            running = lc.state in (InstanceState.READY, InstanceState.PARKED)
            if running and proc is not None and proc.exited():
                code = proc.proc.returncode if proc.proc is not None else None
                lc.failure = f"the engine exited with status {code}"
                await engines.stop_one(lc, lc.failure)
                engines.move(lc, InstanceState.FAILED, lc.failure)
        if not _quiet(life):
            continue
        cycle = life.deployment.lifecycle
        idle_for = now - life.last_used
        if life.ready and cycle.ready_idle_timeout is not None:
            if idle_for >= cycle.ready_idle_timeout:
                lifecycle.rest(life, "idle for lifecycle.ready_idle_timeout")
        elif (
            cycle.parked_idle_timeout is not None
            and life.launched
            and all(lc.state is InstanceState.PARKED for lc in life.launched)
            and now - max(lc.since for lc in life.launched) >= cycle.parked_idle_timeout
        ):
            lifecycle.rest(life, "parked for lifecycle.parked_idle_timeout", may_park=False)
