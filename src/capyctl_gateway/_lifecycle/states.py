"""The states of launched instances and deployments (plain data)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import StrEnum

from .._config import Deployment
from .._deployments.routes import EngineInstance, Route

__all__ = ["HOLDING", "STARTABLE", "DeploymentLife", "InstanceState", "Launched"]


class InstanceState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    PARKING = "parking"
    PARKED = "parked"
    WAKING = "waking"
    STOPPING = "stopping"
    FAILED = "failed"


STARTABLE = frozenset({InstanceState.STOPPED, InstanceState.FAILED})
HOLDING = frozenset(
    {
        InstanceState.STARTING,
        InstanceState.READY,
        InstanceState.STOPPING,
        InstanceState.PARKING,
        InstanceState.WAKING,
    }
)
"""States in which an instance holds its ready memory."""


@dataclass(eq=False)
class Launched:
    """One launched instance: its state (its process is its runner's)."""

    inst: EngineInstance
    state: InstanceState = InstanceState.STOPPED
    since: float = field(default_factory=time.monotonic)
    failure: str | None = None


@dataclass(eq=False)
class DeploymentLife:
    route: Route
    launched: list[Launched]
    last_used: float = field(default_factory=time.monotonic)
    activation: asyncio.Task[None] | None = None
    closing: asyncio.Task[None] | None = None
    draining: bool = False
    """An operator's stop or park is letting its running requests finish."""
    operator_stopped: bool = False
    """An operator stopped it: requests get 409 deployment_stopped until an operator starts it."""
    operator_started: bool = False
    """An operator started it (what ``activation: explicit`` waits for)."""

    @property
    def parks(self) -> bool:
        """A park keeps the process up (``park: sleep``); otherwise a park is a stop."""
        return self.route.deployment.parks

    @property
    def deployment(self) -> Deployment:
        return self.route.deployment

    @property
    def ready(self) -> bool:
        return any(lc.state is InstanceState.READY for lc in self.launched)

    @property
    def state(self) -> str:
        states = {lc.state for lc in self.launched}
        for s in (
            InstanceState.READY,
            InstanceState.WAKING,
            InstanceState.STARTING,
            InstanceState.PARKING,
            InstanceState.STOPPING,
            InstanceState.PARKED,
        ):
            if s in states:
                return s.value
        return "failed" if states == {InstanceState.FAILED} else "stopped"
