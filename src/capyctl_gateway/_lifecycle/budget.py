"""The memory budget of launched deployments, kept as a ledger: what each instance holds or has
been promised, and making room for a start or wake by switching other deployments out.

A start or wake reserves its memory in the same step that checks it (`reserve`: no await
between), so two activations can never both find the same room. After that each transition
sets what the instance holds (`note`): ready memory from its start until it parks or stops,
parked memory while parked (a parked instance that is stopped never holds more on its way
down), nothing once its engine is provably gone. A stop that is not proven (a host that
did not answer) keeps the memory counted.

Making room switches out other deployments, longest unused first and idle before busy; never
one with requests waiting for it, one being activated, one already closing, or one kept ready
(``activation: always``). When none can
go now but another activation or closing is under way, it waits for that and looks again;
when nothing can change, or a switch fails (its running requests did not finish within its
``drain_timeout``), the waiters get a retryable 503.

The budget is per pool: each instance's memory counts against its runner's pool
(`Site.pool`: this machine, or each host in the server role), and every pool has the whole
budget."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .._config import GatewayConfig
from .._errors import UnavailableError
from .states import HOLDING, DeploymentLife, InstanceState, Launched

__all__ = ["MemoryBudget"]


class MemoryBudget:
    def __init__(
        self,
        config: GatewayConfig,
        lives: dict[str, DeploymentLife],
        switch_out: Callable[[DeploymentLife, DeploymentLife], asyncio.Task[bool]],
    ) -> None:
        self._config = config
        self.lives = lives
        self._switch_out = switch_out
        self._holds: dict[Launched, int] = {}

    def held(self) -> int:
        """Memory the launched instances hold or were promised now, on every machine."""
        return sum(self._holds.values())

    def held_in(self, pool: str) -> int:
        """What they hold or were promised in ``pool`` (`Site.pool`)."""
        return sum(n for lc, n in self._holds.items() if _pool(lc) == pool)

    def held_by(self, life: DeploymentLife) -> int:
        return sum(self._holds.get(lc, 0) for lc in life.launched)

    def shares(self) -> dict[str, dict[str, int]]:
        """Per pool, what each deployment with a ``memory:`` holds or was promised there (0
        where nothing), in the configuration's order."""
        out: dict[str, dict[str, int]] = {}
        for name, life in self.lives.items():
            for lc in life.launched if life.deployment.memory is not None else ():
                pool = out.setdefault(_pool(lc), {})
                pool[name] = pool.get(name, 0) + self._holds.get(lc, 0)
        return out

    def note(self, lc: Launched) -> None:
        """Set what ``lc`` holds from the state it just entered."""
        memory = self.lives[lc.inst.deployment].deployment.memory
        if memory is None:
            return
        if lc.state in (InstanceState.PARKING, InstanceState.STOPPING):
            return  # on its way down: what it held until now, never more
        if lc.state in HOLDING:  # starting, ready, waking: reserved before it began
            self._holds[lc] = memory.ready
        elif lc.state is InstanceState.PARKED:
            self._holds[lc] = memory.parked
        elif not lc.unconfirmed:  # stopped or failed, and provably gone
            self._holds.pop(lc, None)

    def reserve(
        self, life: DeploymentLife, starting: list[Launched], waking: list[Launched]
    ) -> bool:
        """Check and reserve, in one step, the memory ``starting`` and ``waking`` need on each
        pool; whether there was room (nothing is reserved when there was not)."""
        budget = self._config.resources.memory_budget
        memory = life.deployment.memory
        if budget is None or memory is None:
            return True
        todo = [*starting, *waking]
        for pool in {_pool(lc) for lc in todo}:
            need = sum(memory.ready - self._holds.get(lc, 0) for lc in todo if _pool(lc) == pool)
            if self.held_in(pool) + need > budget:
                return False
        for lc in todo:
            self._holds[lc] = memory.ready
        return True

    async def make_room(
        self, life: DeploymentLife, starting: list[Launched], waking: list[Launched]
    ) -> None:
        """Reserve what ``life``'s activation needs, switching others out as it must.

        Raises:
            UnavailableError: no room can be made now (retryable).
        """
        while not self.reserve(life, starting, waking):
            pools = {_pool(lc) for lc in [*starting, *waking]}
            victim = self._victim(life, pools)
            if victim is not None:
                life.blocked = True
                try:
                    came_to_rest = await asyncio.shield(self._switch_out(victim, life))
                finally:
                    life.blocked = False
                if not came_to_rest:
                    refused = life.refusal()  # an operator stopped it meanwhile: say so
                    if refused is not None:
                        raise refused
                    raise UnavailableError(
                        f"deployment {life.deployment.name} needs memory that deployment "
                        f"{victim.deployment.name} holds, and its running requests did not "
                        "finish within its lifecycle.drain_timeout; it serves on",
                    )
                continue
            under_way = _under_way(self.lives, life)
            if not under_way:
                budget = self._config.resources.memory_budget
                raise UnavailableError(
                    f"deployment {life.deployment.name} needs more of the memory budget "
                    f"({budget}) than is free, and every deployment holding it has requests "
                    "waiting or running that it must serve first"
                )
            life.blocked = True
            try:
                await asyncio.wait(under_way, return_when=asyncio.FIRST_COMPLETED)
            finally:
                life.blocked = False

    def _victim(self, target: DeploymentLife, pools: set[str]) -> DeploymentLife | None:
        candidates = [
            life
            for life in self.lives.values()
            if life is not target
            and life.closing is None
            and not life.activating
            and life.route.queue.waiting == 0
            and life.deployment.lifecycle.activation != "always"
            and any(_pool(lc) in pools and self._holds.get(lc, 0) > 0 for lc in life.launched)
        ]
        return min(candidates, key=_unused_first, default=None)


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


def _unused_first(life: DeploymentLife) -> tuple[bool, float]:
    """Idle deployments before busy ones; among them the longest unused first."""
    since = life.idle_since
    return (since is None, since or 0.0)
