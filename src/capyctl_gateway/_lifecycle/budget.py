"""The memory budget of launched deployments, kept as a ledger: what each instance holds or has
been promised, and making room for a start or wake by switching other deployments out.

A start or wake reserves its memory in the same step that checks it (`reserve`: no await
between), so two activations can never both find the same room. After that each transition
sets what the instance holds (`note`): ready memory from its start until it parks or stops,
parked memory while parked (a parked instance that is stopped never holds more on its way
down), nothing once its engine is provably gone. A stop that is not proven (a host that
did not answer, a pod whose delete is owed) keeps the memory counted; a start of that instance
before the proof reserves its own memory beside it (the earlier engine's is counted apart,
as lingering, until the instance's engines are provably gone).

Making room switches out other deployments: which and when is the scheduler's
(``_scheduling/``: ``resources.switching``); never one being activated, one already closing, or
one kept ready (``activation: always``). While the scheduler waits (its time, the resident one
going quiet), or another activation or closing is under way, or memory is held by an engine
whose stop is not proven yet (a pod whose delete is owed), the activation waits for that and
looks again;
when nothing can change, or a switch fails (its running requests did not finish within its
``drain_timeout``), the waiters get a retryable 503.

The budget is per pool: each instance's memory counts against its runner's pool
(`Site.pool`: this machine, or each host in the server role), and every pool has the whole
budget."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .._config import GatewayConfig
from .._scheduling.scheduler import Scheduler
from .history import PoolHistory
from .room import make_room
from .states import HOLDING, DeploymentLife, InstanceState, Launched

__all__ = ["MemoryBudget"]


class MemoryBudget:
    def __init__(
        self,
        config: GatewayConfig,
        lives: dict[str, DeploymentLife],
        switch_out: Callable[[DeploymentLife, DeploymentLife], asyncio.Task[bool]],
        scheduler: Scheduler,
    ) -> None:
        self.config, self.scheduler, self.lives = config, scheduler, lives
        self.switch_out = switch_out
        self._holds: dict[Launched, int] = {}
        self._lingering: dict[Launched, int] = {}
        """What an instance's earlier engine, not provably gone, holds beside its own."""
        self._changed = asyncio.Event()
        self.history = PoolHistory()  # what each pool held lately (the console's budget view)
        self._promised: dict[str, dict[DeploymentLife, int]] = {}
        """pool -> each deployment a switch there is making room for, and what it needs: that
        room is its own (another's activation that comes meanwhile does not take it)."""

    def _of(self, lc: Launched) -> int:
        return self._holds.get(lc, 0) + self._lingering.get(lc, 0)

    def held(self) -> int:
        """Memory the launched instances hold or were promised now, on every machine."""
        return sum(self._holds.values()) + sum(self._lingering.values())

    def held_in(self, pool: str) -> int:
        """What they hold or were promised in ``pool`` (`Site.pool`)."""
        return sum(self._of(lc) for lc in {*self._holds, *self._lingering} if _pool(lc) == pool)

    def held_by(self, life: DeploymentLife) -> int:
        return sum(self._of(lc) for lc in life.launched)

    def shares(self) -> dict[str, dict[str, int]]:
        """Per pool, what each deployment with a ``memory:`` holds or was promised there."""
        out: dict[str, dict[str, int]] = {}
        for name, life in self.lives.items():
            for lc in life.launched if life.deployment.memory is not None else ():
                pool = out.setdefault(_pool(lc), {})
                pool[name] = pool.get(name, 0) + self._of(lc)
        return out

    def note(self, lc: Launched) -> None:
        """Set what ``lc`` holds from the state it just entered."""
        if (memory := self.lives[lc.inst.deployment].deployment.memory) is None:
            return
        self._changed.set()  # who waits for memory to be freed looks again
        self._changed = asyncio.Event()
        if not lc.unconfirmed:  # every engine it ran is provably gone
            self._lingering.pop(lc, None)
        if lc.state in (InstanceState.PARKING, InstanceState.STOPPING):
            pass  # on its way down: what it held until now, never more
        elif lc.state in HOLDING:  # starting, ready, waking: reserved before it began
            self._holds[lc] = memory.ready
        elif lc.state is InstanceState.PARKED:
            self._holds[lc] = memory.parked
        elif not lc.unconfirmed:  # stopped or failed, and provably gone
            self._holds.pop(lc, None)
        else:  # stopped or failed, its end unproven: counted as one engine that may still run
            held = max(self._holds.pop(lc, 0), self._lingering.pop(lc, 0))
            if held:
                self._holds[lc] = held
        self.history.record(self.shares())

    def reserve(
        self, life: DeploymentLife, starting: list[Launched], waking: list[Launched]
    ) -> bool:
        """Check and reserve, in one step, the memory ``starting`` and ``waking`` need on each
        pool; whether there was room (nothing is reserved when there was not)."""
        budget = self.config.resources.memory_budget
        memory = life.deployment.memory
        if budget is None or memory is None:
            return True
        for lc in starting:  # an earlier engine not provably gone: its memory counted apart
            if lc.unconfirmed and lc in self._holds:
                self._lingering[lc] = self._lingering.get(lc, 0) + self._holds.pop(lc)
        todo = [*starting, *waking]
        for pool in {_pool(lc) for lc in todo}:
            need = sum(memory.ready - self._holds.get(lc, 0) for lc in todo if _pool(lc) == pool)
            if self.held_in(pool) + _kept(self._promised, pool, life) + need > budget:
                return False
        for lc in todo:
            self._holds[lc] = memory.ready
        self.history.record(self.shares())
        return True

    async def make_room(
        self, life: DeploymentLife, starting: list[Launched], waking: list[Launched]
    ) -> bool:
        """Reserve what ``life``'s activation needs, switching others out as the scheduler
        says; False when nobody waits for it any more (``room.py``)."""
        return await make_room(self, life, starting, waking)

    def promise(self, life: DeploymentLife, needs: dict[str, int]) -> bool:
        """Keep ``needs`` (per pool; {}: no more) of the room a switch frees for ``life``, if it
        fits beside what others are kept (two that did not would wait for each other for good)."""
        total = self.config.resources.memory_budget or 0
        if any(_kept(self._promised, p, life) + n > total for p, n in needs.items()):
            return False
        for room in self._promised.values():
            room.pop(life, None)
        for pool, n in needs.items():
            self._promised.setdefault(pool, {})[life] = n
        return True

    def promised(self, pool: str) -> list[DeploymentLife]:
        """The deployments a switch makes room for in ``pool`` now."""
        return list(self._promised.get(pool, {}))

    def holds(self, lc: Launched) -> int:  # its earlier engine's lingering memory aside
        return self._holds.get(lc, 0)

    def unproven(self, pools: set[str]) -> bool:
        """Whether memory in ``pools`` is held by an engine whose stop is not proven yet."""
        return any(lc.unconfirmed and _pool(lc) in pools for lc in self._holds)

    async def changed(self) -> None:
        """Return at the next change of what is held."""
        await self._changed.wait()


def _pool(lc: Launched) -> str:
    return lc.inst.runner.site.pool


def _kept(promised: dict[str, dict[DeploymentLife, int]], pool: str, life: DeploymentLife) -> int:
    """The room in ``pool`` switches make for deployments other than ``life``."""
    return sum(n for owner, n in promised.get(pool, {}).items() if owner is not life)
