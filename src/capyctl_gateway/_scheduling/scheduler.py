"""The scheduler of one gateway's memory pools: what the lifecycle asks while an activation waits
for room (``policy.py`` decides), what each switch costs (``costs.py``), and what it means to do
next in each pool and why (``status``, ``list`` and the console show it)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .._clock import stamp
from .._config import GatewayConfig
from .._lifecycle.states import DeploymentLife
from .costs import Costs
from .policy import REASONS, Switch, Wait, decide

__all__ = ["REASONS", "Intent", "Scheduler", "Switch", "Wait"]


@dataclass(frozen=True, slots=True)
class Intent:
    """The switch a pool's scheduler means to make next."""

    out: str
    into: str
    at: float | None
    """When at the latest (``_clock.stamp``); None: once the resident one has nothing to do."""
    why: str

    def row(self, now: float) -> dict[str, object]:
        due = None if self.at is None else round(max(self.at - now, 0.0), 1)
        return {"out": self.out, "in": self.into, "in_s": due, "why": self.why}


class Scheduler:
    """When to switch, for every pool of one gateway."""

    def __init__(self, config: GatewayConfig) -> None:
        resources = config.resources
        self.policy = resources.switching
        self.patience = resources.switch_patience
        self.max_wait = resources.max_switch_wait
        self.costs = Costs()
        self.switches: Counter[str] = Counter()
        """reason (one of `REASONS`) -> switches made for it."""
        self.intents: dict[str, Intent] = {}
        """pool -> the switch it means to make next (while an activation waits there)."""

    def decide(
        self,
        into: DeploymentLife,
        candidates: list[DeploymentLife],
        waiting: list[DeploymentLife],
        pools: set[str],
    ) -> Switch | Wait | None:
        """What the activation of ``into`` does about room in ``pools`` (see ``policy.py``)."""
        verdict = decide(
            self.policy,
            into,
            candidates,
            waiting,
            self.costs,
            stamp(),
            patience=self.patience,
            max_wait=self.max_wait,
        )
        for pool in pools:
            if isinstance(verdict, Wait) and verdict.out is not None:
                out = verdict.out.deployment.name
                self.intents[pool] = Intent(out, into.deployment.name, verdict.until, verdict.why)
            else:
                self.intents.pop(pool, None)
        if isinstance(verdict, Switch):
            self.switches[verdict.reason] += 1
        return verdict

    def settled(self, pools: set[str]) -> None:
        """Nothing waits for room in ``pools`` any more."""
        for pool in pools:
            self.intents.pop(pool, None)
