"""Engines that exit without being asked: seen at once, their instance failed, restarted for the
requests that wait, and restarted with a growing delay when they keep crashing.

While an instance is ready or parked, a task waits on its runner's `Runner.gone` (the process's
own exit on this machine: no polling); the idle watch's look once a second is the fallback. A
lost engine's instance is stopped (its group killed, its cut requests settled: a crashed engine
runs nothing) and turns ``failed``; the deployment's gate shuts, so requests that arrive wait,
and if any wait (in the queue, or with a slot for an instance: one its dead engine's port
refused before its exit was seen), its activation starts it again. Each crash in a row doubles
the delay before the next start (`BACKOFF_FIRST_S` up to `BACKOFF_MAX_S`); an instance ready
`STEADY_S` in all since its last failure starts the count afresh (`count_failure`; a failed
start or wake counts too). ``status`` shows the delay while it runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._clock import stamp
from .states import RESTARTED, DeploymentLife, InstanceState, Launched, waited_for

if TYPE_CHECKING:
    from .controller import Lifecycle

__all__ = [
    "BACKOFF_FIRST_S",
    "BACKOFF_MAX_S",
    "STEADY_S",
    "backoff_left",
    "count_failure",
    "exit_watch",
    "lost",
]

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
STEADY_S = 60.0
"""Ready this long since its last failure, an instance's next failure starts its count afresh."""


def count_failure(lc: Launched, now: float) -> None:
    """Count a failed start or wake, or an exit nobody asked for: one more in a row, or the
    first of a new row where ``lc`` has been ready `STEADY_S` in all since its last failure (a
    spare serves in short stretches; an engine that crashes as soon as it starts never adds
    up to it)."""
    ready = now - lc.since if lc.state is InstanceState.READY else 0.0  # a stretch under way
    lc.crashes = 1 if lc.served_s + ready >= STEADY_S else lc.crashes + 1
    lc.crashed_at, lc.served_s = now, -ready  # from now on, from nothing (`Launched.enter`)


def backoff_left(lc: Launched, now: float) -> float:
    """How long the next start of ``lc`` must still wait (0 when it may start now)."""
    if lc.crashes < 2:  # the first crash restarts at once
        return 0.0
    delay = min(BACKOFF_FIRST_S * 2.0 ** (lc.crashes - 2), BACKOFF_MAX_S)
    return max(lc.crashed_at + delay - now, 0.0)


def exit_watch(lifecycle: Lifecycle) -> Callable[[Launched], None]:
    """A transition observer: a task waits for each ready engine's unasked exit, and ends when
    the instance is stopped."""

    def observe(lc: Launched) -> None:
        up = lc.state in (InstanceState.READY, InstanceState.PARKED)
        if up and lc.watch is None:
            what = f"watching {lc.inst.where} for its exit"
            lc.watch = lifecycle.tasks.spawn(_watch(lifecycle, lc), kind="exit_watch", what=what)
        elif lc.state in (InstanceState.STOPPED, InstanceState.FAILED) and lc.watch is not None:
            if lc.watch is not asyncio.current_task():
                lc.watch.cancel()
            lc.watch = None

    return observe


async def _watch(lifecycle: Lifecycle, lc: Launched) -> None:
    why = await lc.inst.runner.gone()
    if lc.state in (InstanceState.READY, InstanceState.PARKED):
        await lost(lifecycle, lifecycle.lives[lc.inst.deployment], lc, why)


async def lost(lifecycle: Lifecycle, life: DeploymentLife, lc: Launched, why: str) -> None:
    """``lc``'s engine exited unasked (``why``): fail it, and start it again for the requests
    that wait for it."""
    count_failure(lc, stamp())
    lc.failure = why
    engines = lifecycle.engines
    await engines.stop_one(lc, why)  # its group killed; nothing it counted still runs
    engines.move(lc, InstanceState.FAILED, why)
    kept = life.deployment.lifecycle.activation == "always"
    if (waited_for(life) or kept) and not life.ready and life.refusal() is None:
        lifecycle.activate(life, RESTARTED)
