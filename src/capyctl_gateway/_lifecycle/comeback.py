"""Deployments marked to come back (``lifecycle.come_back``): one that a switch took out to make
room for another starts again by itself once the memory budget has room for it.

A switch that came to rest marks the deployment displaced (`switched_out`). After any
transition that frees memory (a stop, a park, a failure), a look in the next loop turn (`watch`)
starts each displaced deployment that fits now: it reserves the room and starts the activation
in one step, so that it never switches another deployment out for that, and never races
another activation for the room. Whatever starts or wakes it ends its being displaced; while an
operator's stop holds it (or ``activation: explicit`` waits for an operator), it does not come
back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .states import STARTABLE, DeploymentLife, InstanceState, Launched

if TYPE_CHECKING:
    from .controller import Lifecycle

__all__ = ["COME_BACK_REASON", "switched_out", "watch"]

COME_BACK_REASON = "came back: the memory budget has room for it again"
_FREEING = (InstanceState.STOPPED, InstanceState.PARKED, InstanceState.FAILED)
_RISING = (InstanceState.STARTING, InstanceState.WAKING)


def switched_out(life: DeploymentLife, closing: asyncio.Task[bool]) -> asyncio.Task[bool]:
    """``closing`` switches ``life`` out: once it has come to rest, ``life`` is displaced.
    Returns ``closing``."""

    def ended(task: asyncio.Task[bool]) -> None:
        if not task.cancelled() and task.exception() is None and task.result():
            life.displaced = True

    closing.add_done_callback(ended)
    return closing


def watch(lifecycle: Lifecycle) -> Callable[[Launched], None]:
    """A transition observer: after memory is freed, a look for deployments to bring back.

    It looks only while nothing else activates or closes (whatever waits for room goes first,
    and a switch under way is not undone); while something does, it looks again once that
    ends."""
    looking = False
    hooked: set[asyncio.Task[Any]] = set()

    def schedule(task: asyncio.Task[Any] | None = None) -> None:
        nonlocal looking
        if task is not None:
            hooked.discard(task)
        if not looking:
            looking = True
            asyncio.get_running_loop().call_soon(look)

    def look() -> None:
        nonlocal looking
        looking = False
        try:
            bring_back()
        except Exception as exc:  # a defect: logged with its traceback, counted; none waits
            lifecycle.tasks.fault("activation", "bringing deployments back", exc)

    def bring_back() -> None:
        lives = list(lifecycle.lives.values())
        busy = [t for life in lives for t in (life.activation, life.closing) if t and not t.done()]
        if busy:
            for task in set(busy) - hooked:
                hooked.add(task)
                task.add_done_callback(schedule)
            return
        for life in lives:
            if _may_come_back(life) and _fits(lifecycle, life):
                life.displaced = False
                lifecycle.activate(life, COME_BACK_REASON)

    def observe(lc: Launched) -> None:
        life = lifecycle.lives[lc.inst.deployment]
        if lc.state in _RISING:
            life.displaced = False  # started or woken, whoever asked
        elif lc.state in _FREEING:
            schedule()

    return observe


def _may_come_back(life: DeploymentLife) -> bool:
    return (
        life.displaced
        and life.deployment.lifecycle.come_back
        and life.refusal() is None
        and life.closing is None
        and not life.activating
        and not life.ready
    )


def _fits(lifecycle: Lifecycle, life: DeploymentLife) -> bool:
    """Reserve what ``life``'s start needs now, if the budget has it (without a switch)."""
    todo = [lc for lc in life.launched if lc.state in STARTABLE]
    parked = [lc for lc in life.launched if lc.state is InstanceState.PARKED]
    return bool(todo or parked) and lifecycle.budget.reserve(life, todo, parked)
