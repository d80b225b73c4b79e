"""The states of launched instances and deployments (plain data)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum

from .._clock import stamp
from .._config import Deployment
from .._deployments.routes import EngineInstance, Route
from .._errors import DeploymentStoppedError
from .._log import event

__all__ = [
    "HOLDING",
    "REQUESTED",
    "RESTARTED",
    "STARTABLE",
    "AbandonedError",
    "DeploymentLife",
    "InstanceState",
    "Launched",
    "Starts",
    "waited_for",
]


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
REQUESTED = "a request is waiting"
"""Why an activation that requests asked for begins (`DeploymentLife.for_requests`)."""
RESTARTED = "started again after its engine exited"
"""Why an activation begins after a crash: for the requests that wait (unless it is kept
ready, ``activation: always``)."""


@dataclass(eq=False)
class Launched:
    """One launched instance: its state (its process is its runner's)."""

    inst: EngineInstance
    state: InstanceState = InstanceState.STOPPED
    since: float = field(default_factory=stamp)
    failure: str | None = None
    crashes: int = 0
    """Failed starts and wakes and exits nobody asked for, in a row (a row ends once it has
    served ``crash.STEADY_S`` since the last: `crash.count_failure`)."""
    crashed_at: float = 0.0
    served_s: float = 0.0
    """How long it has been ready since its last failure, in all (`crash.count_failure`)."""
    watch: asyncio.Task[None] | None = None
    """Waits for the engine to exit unasked while it runs (`Runner.gone`)."""
    stopping: asyncio.Future[None] | None = None
    """Done when the stop under way ends (None while none is): an activation waits for it
    before it starts the instance again (a crash's stop, which no closing announces)."""
    rested: bool = False
    """Parked (or stopped) alone as a spare, while its deployment serves on, until it is ready
    again (one whose wake failed stays a spare: ``spares.py``)."""
    unconfirmed: bool = False
    """Its last stop was not proven (a host that did not answer): the memory it held stays
    counted until a proven stop or its host's report that the engine is gone."""

    def enter(self, to: InstanceState, now: float) -> None:
        """Take state ``to`` (`Transitions.move`): a stop's future is made as it begins, and
        done as it ends."""
        if self.state is InstanceState.READY:
            self.served_s += now - self.since
        if to is not InstanceState.STOPPING:
            self.stop_over()
        elif self.stopping is None:
            self.stopping = asyncio.get_running_loop().create_future()
        self.state, self.since = to, now

    def stop_over(self) -> None:
        """The stop under way is over, however it ended (one that raised too): whoever waits
        for it goes on."""
        if self.stopping is not None:
            self.stopping.set_result(None)
            self.stopping = None


class AbandonedError(Exception):
    """A start (or the wait before it) was abandoned: an operator stopped its deployment."""


class Starts:
    """What a deployment's activation waits for that an operator's stop ends at once: its
    instances' starts (a pod that waits for a node, an engine loading its model) and the crash
    backoff before them."""

    def __init__(self) -> None:
        self._scopes: set[asyncio.Timeout] = set()

    @contextlib.asynccontextmanager
    async def abandonable(self) -> AsyncIterator[None]:
        """Run the body until `abandon`; raises AbandonedError if it was abandoned (the body
        is cancelled first, and its own cleanup runs)."""
        try:
            async with asyncio.timeout(None) as scope:
                self._scopes.add(scope)
                try:
                    yield
                finally:
                    self._scopes.discard(scope)
        except TimeoutError:
            if scope.expired():
                raise AbandonedError from None
            raise

    @staticmethod
    async def again_while_abandoned(bring_up: Callable[[], Awaitable[None]]) -> None:
        """Run ``bring_up`` (an activation's starts) again each time it ends in AbandonedError:
        an operator's stop abandoned its starts, and an operator's start came after that stop
        (the operator's last word: the deployment starts)."""
        while True:
            try:
                return await bring_up()
            except AbandonedError:
                continue

    def abandon(self) -> int:
        """End every start under way now; how many there were."""
        now = asyncio.get_running_loop().time()
        scopes = list(self._scopes)
        for scope in scopes:
            scope.reschedule(now)
        return len(scopes)


@dataclass(eq=False)
class DeploymentLife:
    route: Route
    launched: list[Launched]
    activation: asyncio.Task[None] | None = None
    """The activation of the current wave of waiting requests, while it runs."""
    for_requests: bool = False
    """Only requests asked for the activation under way (no operator, no come back, no
    restart): once none of them waits, it switches nothing out for them (``room.py``)."""
    blocked: bool = False
    """Its activation waits for memory that another deployment holds (see `MemoryBudget`)."""
    closing: asyncio.Task[bool] | None = None
    """Its closing (a switch out, an idle park or stop, an operator's park or stop), while it
    runs: the queue's gate is shut meanwhile. Its result: whether it came to rest."""
    operator_stopped: bool = False
    """An operator stopped it: requests get 409 deployment_stopped until an operator starts it."""
    operator_started: bool = False
    """An operator started it (what ``activation: explicit`` waits for)."""
    displaced: bool = False
    """A switch took it out for another deployment, and nothing has started it since: with
    ``lifecycle.come_back`` it starts again once the budget has room (``comeback.py``)."""
    spare: asyncio.Task[None] | None = None
    """A spare's park or wake under way (``spares.py``): a closing or activation waits for it."""
    waking: Launched | None = None
    """The spare that task wakes (set as it is spawned: requests that come before it join it)."""
    resting: bool = False
    """Its closing is past its drain and puts it to rest: an instance that comes up stays shut."""
    starts: Starts = field(default_factory=Starts)
    """Its starts under way, which an operator's stop abandons."""

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

    def refusal(self) -> DeploymentStoppedError | None:
        """Why a request may not start it: an operator stopped it, or it starts only when an
        operator starts it (``activation: explicit``); None when it may."""
        name = self.deployment.name
        if self.operator_stopped:
            return DeploymentStoppedError(
                f"deployment {name} was stopped by an operator; "
                f"`capyctl start {name}` starts it again"
            )
        if self.deployment.lifecycle.activation == "explicit" and not self.operator_started:
            return DeploymentStoppedError(
                f"deployment {name} starts only when an operator starts it "
                "(lifecycle.activation: explicit)",
                code="deployment_inactive",
            )
        return None

    @property
    def serves_now(self) -> bool:
        """Whether requests may take running slots: an instance is ready and nothing closes
        the deployment."""
        return self.ready and self.closing is None

    @property
    def activating(self) -> bool:
        return self.activation is not None and not self.activation.done()

    def wanted(self, why: str) -> bool:
        """``why`` (`REQUESTED`, `RESTARTED` or another reason) wants it active: noted in
        `for_requests`; whether a new activation must begin (none is under way)."""
        new = not self.activating
        restart = why == RESTARTED and self.deployment.lifecycle.activation != "always"
        self.for_requests = (why == REQUESTED or restart) and (new or self.for_requests)
        return new

    @property
    def idle_since(self) -> float | None:
        """Since when no request has run (``_clock.stamp``); None while one runs."""
        queue = self.route.queue
        return None if queue.running or queue.waiting else queue.idle_since

    def regate(self, why: str) -> None:
        """Open the queue's gate exactly while the deployment serves now (the one place the
        gate of a launched deployment changes); log the change."""
        queue, now = self.route.queue, self.serves_now
        if queue.open is now:
            return
        queue.set_open(now)
        refused = self.refusal()  # an operator's stop: requests get 409, they do not wait
        event(
            "dispatch",
            "deployment %s: %s (%s)",
            self.deployment.name,
            "admits requests"
            if now
            else f"admits none; requests get {refused.code}"
            if refused is not None
            else "admits none; requests wait",
            why,
            deployment=self.deployment.name,
            state="open" if now else "closed",
            reason=why,
        )

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


def waited_for(life: DeploymentLife) -> bool:
    """Requests wait for ``life``: in its queue, or (holding a slot) for an instance."""
    return bool(life.route.queue.waiting or life.route.waiters.waiting)
