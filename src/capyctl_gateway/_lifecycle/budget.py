"""The memory budget of launched deployments: what they hold, and making room for a start by
switching idle deployments out (longest unused first; never one with waiting requests, nor one
that is starting).

The budget is per machine: with hosts (the server role), each host's instances are counted
against it separately (a host is None on a single machine)."""

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
        switch_out: Callable[[DeploymentLife], asyncio.Task[None]],
    ) -> None:
        self._config = config
        self.lives = lives
        self._switch_out = switch_out

    def held(self) -> int:
        """Memory the launched instances hold now (ready, or on their way in or out)."""
        return self.held_on(None, everywhere=True)

    def held_on(self, host: str | None, *, everywhere: bool = False) -> int:
        """What they hold on ``host`` (None: this machine)."""
        total = 0
        for life in self.lives.values():
            memory = life.deployment.memory
            if memory is None:
                continue
            for lc in life.launched:
                if not everywhere and lc.inst.runner.host != host:
                    continue
                if lc.state in HOLDING:
                    total += memory.ready
                elif lc.state is InstanceState.PARKED:
                    total += memory.parked
        return total

    async def make_room(
        self, life: DeploymentLife, starting: list[Launched], waking: list[Launched]
    ) -> None:
        budget = self._config.resources.memory_budget
        memory = life.deployment.memory
        if budget is None or memory is None:
            return
        for host in {lc.inst.runner.host for lc in [*starting, *waking]}:
            need = memory.ready * sum(1 for lc in starting if lc.inst.runner.host == host) + (
                memory.ready - memory.parked
            ) * sum(1 for lc in waking if lc.inst.runner.host == host)
            while self.held_on(host) + need > budget:
                victim = self._victim(life, host)
                where = "" if host is None else f" on host {host}"
                if victim is None:
                    raise UnavailableError(
                        f"deployment {life.deployment.name} needs {need} bytes of the memory "
                        f"budget ({budget}){where}; {self.held_on(host)} are held and no idle "
                        "deployment can give them back now"
                    )
                await asyncio.shield(self._switch_out(victim))

    def _victim(self, target: DeploymentLife, host: str | None) -> DeploymentLife | None:
        candidates = [
            life
            for life in self.lives.values()
            if life is not target
            and any(
                lc.inst.runner.host == host
                and (
                    lc.state in HOLDING
                    or (lc.state is InstanceState.PARKED and memory_of(life) > 0)
                )
                for lc in life.launched
            )
            and life.route.queue.waiting == 0
            and (life.activation is None or life.activation.done())
        ]
        return min(candidates, key=lambda life: life.last_used, default=None)


def memory_of(life: DeploymentLife) -> int:
    """What one parked instance of ``life`` holds."""
    memory = life.deployment.memory
    return memory.parked if memory is not None else 0
