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

Making room switches out other deployments, longest unused first and idle before busy; never
one with requests waiting for it, one being activated, one already closing, or one kept ready
(``activation: always``). When none can
go now but another activation or closing is under way, or memory is held by an engine whose
stop is not proven yet (a pod whose delete is owed), it waits for that and looks again;
when nothing can change, or a switch fails (its running requests did not finish within its
``drain_timeout``), the waiters get a retryable 503.

The budget is per pool: each instance's memory counts against its runner's pool
(`Site.pool`: this machine, or each host in the server role), and every pool has the whole
budget."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

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
        self._lingering: dict[Launched, int] = {}
        """What an instance's earlier engine, not provably gone, holds beside its own."""
        self._changed = asyncio.Event()

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
        """Per pool, what each deployment with a ``memory:`` holds or was promised there (0
        where nothing), in the configuration's order."""
        out: dict[str, dict[str, int]] = {}
        for name, life in self.lives.items():
            for lc in life.launched if life.deployment.memory is not None else ():
                pool = out.setdefault(_pool(lc), {})
                pool[name] = pool.get(name, 0) + self._of(lc)
        return out

    def note(self, lc: Launched) -> None:
        """Set what ``lc`` holds from the state it just entered."""
        memory = self.lives[lc.inst.deployment].deployment.memory
        if memory is None:
            return
        self._changed.set()  # who waits for memory to be freed looks again
        self._changed = asyncio.Event()
        if not lc.unconfirmed:  # every engine it ran is provably gone
            self._lingering.pop(lc, None)
        if lc.state in (InstanceState.PARKING, InstanceState.STOPPING):
            return  # on its way down: what it held until now, never more
        if lc.state in HOLDING:  # starting, ready, waking: reserved before it began
            self._holds[lc] = memory.ready
        elif lc.state is InstanceState.PARKED:
            self._holds[lc] = memory.parked
        elif not lc.unconfirmed:  # stopped or failed, and provably gone
            self._holds.pop(lc, None)
        else:  # stopped or failed, its end unproven: counted as one engine that may still run
            held = max(self._holds.pop(lc, 0), self._lingering.pop(lc, 0))
            if held:
                self._holds[lc] = held

    def reserve(
        self, life: DeploymentLife, starting: list[Launched], waking: list[Launched]
    ) -> bool:
        """Check and reserve, in one step, the memory ``starting`` and ``waking`` need on each
        pool; whether there was room (nothing is reserved when there was not)."""
        budget = self._config.resources.memory_budget
        memory = life.deployment.memory
        if budget is None or memory is None:
            return True
        for lc in starting:  # an earlier engine not provably gone: its memory counted apart
            if lc.unconfirmed and lc in self._holds:
                self._lingering[lc] = self._lingering.get(lc, 0) + self._holds.pop(lc)
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
            victim = _victim(self.lives, life, pools, self._holds)
            if victim is not None:
                with _blocked(life):
                    came_to_rest = await asyncio.shield(self._switch_out(victim, life))
                if not came_to_rest:
                    raise life.refusal() or _serves_on(life, victim)
                continue
            under_way = _under_way(self.lives, life)
            unproven = any(lc.unconfirmed and _pool(lc) in pools for lc in self._holds)
            if not under_way and not unproven:
                budget = self._config.resources.memory_budget
                raise UnavailableError(
                    f"deployment {life.deployment.name} needs more of the memory budget "
                    f"({budget}) than is free, and every deployment holding it has requests "
                    "waiting or running that it must serve first"
                )
            with _blocked(life):  # an activation or closing ends, or a stop is proven
                changed = asyncio.ensure_future(self._changed.wait())
                try:
                    await asyncio.wait([*under_way, changed], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()


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


def _victim(
    lives: dict[str, DeploymentLife],
    target: DeploymentLife,
    pools: set[str],
    holds: dict[Launched, int],
) -> DeploymentLife | None:
    """The deployment to switch out for ``target``: one whose ready or parked engine holds
    memory in ``pools`` (what a stopped one holds waits for the proof of its stop)."""
    up = (InstanceState.READY, InstanceState.PARKED)
    candidates = [
        life
        for life in lives.values()
        if life is not target
        and life.closing is None
        and not life.activating
        and life.route.queue.waiting == 0
        and life.deployment.lifecycle.activation != "always"
        and any(
            _pool(lc) in pools and lc.state in up and holds.get(lc, 0) > 0 for lc in life.launched
        )
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
