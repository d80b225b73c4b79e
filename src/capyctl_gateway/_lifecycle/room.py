"""Making room in the memory budget for an activation (`MemoryBudget.make_room`): the scheduler
says which deployment to switch out and when (``_scheduling/``); this waits meanwhile, and has
the lifecycle switch out the one it names. The room a switch frees is promised to the
activation it was made for: another that comes meanwhile waits for that activation first, and
is itself promised room only where it fits beside what others are (`MemoryBudget.promise`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .._clock import stamp
from .._errors import UnavailableError
from .._scheduling.scheduler import Switch, Wait
from .states import DeploymentLife, InstanceState, Launched, waited_for

if TYPE_CHECKING:
    from .budget import MemoryBudget

__all__ = ["make_room"]

logger = logging.getLogger("capyctl_gateway")


async def make_room(
    budget: MemoryBudget, life: DeploymentLife, starting: list[Launched], waking: list[Launched]
) -> bool:
    """Reserve what ``life``'s activation needs in ``budget``, switching others out as the
    scheduler says; False (nothing reserved) when only requests asked for it and none of them
    waits any more: nothing is switched out for nobody. Raises UnavailableError (retryable)
    when no room can be made now."""
    pools = {_pool(lc) for lc in [*starting, *waking]}
    scheduler, name = budget.scheduler, life.deployment.name
    try:
        while not budget.reserve(life, starting, waking):
            if life.for_requests and not waited_for(life):  # they hung up, or timed out
                logger.info("deployment %s: not started: no request waits for it any more", name)
                return False
            candidates = _candidates(budget, life, pools)
            verdict = scheduler.decide(life, candidates, _waiting(budget, life, pools), pools)
            if isinstance(verdict, Switch):
                if not budget.promise(life, _needs(life, [*starting, *waking])):
                    await _wait(budget, life, pools, None)  # another's promised room goes first
                    continue
                with _blocked(life):
                    came_to_rest = await asyncio.shield(budget.switch_out(verdict.out, life))
                if not came_to_rest:
                    raise life.refusal() or _serves_on(life, verdict.out)
                continue
            await _wait(budget, life, pools, verdict)
        return True
    finally:
        scheduler.settled(pools)
        budget.promise(life, {})


async def _wait(
    budget: MemoryBudget, life: DeploymentLife, pools: set[str], verdict: Wait | None
) -> None:
    """Wait for what may make room: the time the scheduler named, a deployment it watches
    turning quiet or busy, an activation or closing under way ending (the one a switch makes
    room for first), a change of what is held (a stop proven). Raises UnavailableError when
    nothing can."""
    under_way: list[asyncio.Future[Any]] = list(_under_way(budget.lives, life))
    if verdict is not None and verdict.after is not None and verdict.after.activation is not None:
        under_way.append(verdict.after.activation)  # the one that goes first: once it is in
    owners = {o for pool in pools for o in budget.promised(pool)} - {life}
    under_way += [o.activation for o in owners if o.activation is not None]  # they go first
    if verdict is None and not under_way and not budget.unproven(pools):
        raise UnavailableError(
            f"deployment {life.deployment.name} needs more of the memory budget "
            f"({budget.config.resources.memory_budget}) than is free, and every deployment "
            "holding it has requests waiting or running that it must serve first"
        )
    events: list[asyncio.Future[Any]] = [asyncio.ensure_future(budget.changed())]
    watch = (life, *verdict.watch) if verdict is not None else (life,)  # its own: none waits
    events += [asyncio.ensure_future(b.route.queue.turned()) for b in watch]  # busy, or quiet
    left = None if verdict is None or verdict.until is None else verdict.until - stamp()
    with _blocked(life):
        try:
            await asyncio.wait(
                [*under_way, *events], timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for event in events:
                event.cancel()


def _candidates(
    budget: MemoryBudget, target: DeploymentLife, pools: set[str]
) -> list[DeploymentLife]:
    """The deployments the scheduler may switch out for ``target``: one whose ready or parked
    engine holds memory in ``pools`` (what a stopped one holds waits for the proof of its
    stop), not closing, not being activated, not kept ready."""
    up = (InstanceState.READY, InstanceState.PARKED)
    return [
        life
        for life in budget.lives.values()
        if life is not target
        and life.closing is None
        and not life.activating
        and life.deployment.lifecycle.activation != "always"
        and any(
            _pool(lc) in pools and lc.state in up and budget.holds(lc) > 0 for lc in life.launched
        )
    ]


def _waiting(budget: MemoryBudget, target: DeploymentLife, pools: set[str]) -> list[DeploymentLife]:
    """Every deployment waiting for room in ``pools`` now, ``target`` among them."""
    waiting = [
        life
        for life in budget.lives.values()
        if life.blocked and any(_pool(lc) in pools for lc in life.launched)
    ]
    return [*waiting, target] if target not in waiting else waiting


@contextlib.contextmanager
def _blocked(life: DeploymentLife) -> Iterator[None]:
    """``life``'s activation waits for memory another deployment holds meanwhile."""
    life.blocked = True
    try:
        yield
    finally:
        life.blocked = False


def _serves_on(life: DeploymentLife, victim: DeploymentLife) -> UnavailableError:
    return UnavailableError(
        f"deployment {life.deployment.name} needs memory that deployment "
        f"{victim.deployment.name} holds, and its running requests did not "
        "finish within its lifecycle.drain_timeout; it serves on",
    )


def _needs(life: DeploymentLife, todo: list[Launched]) -> dict[str, int]:
    """What ``life``'s instances ``todo`` need in each pool (their ready memory)."""
    memory = life.deployment.memory
    needs: dict[str, int] = {}
    for lc in todo:
        needs[_pool(lc)] = needs.get(_pool(lc), 0) + (memory.ready if memory else 0)
    return needs


def _pool(lc: Launched) -> str:
    return lc.inst.runner.site.pool


def _under_way(
    lives: dict[str, DeploymentLife], target: DeploymentLife
) -> list[asyncio.Task[None] | asyncio.Task[bool]]:
    """Activations (not themselves waiting for room) and closings under way besides
    ``target``'s: what may free or settle memory soon."""
    tasks: list[asyncio.Task[None] | asyncio.Task[bool]] = []
    for life in lives.values():
        if life is target:
            continue
        if life.closing is not None:
            tasks.append(life.closing)
        if life.activation is not None and life.activating and not life.blocked:
            tasks.append(life.activation)
    return tasks
