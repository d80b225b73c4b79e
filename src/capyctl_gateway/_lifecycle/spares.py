"""Spare instances of a deployment of several launched instances
(``lifecycle.spare_idle_timeout``): parked alone while the others serve, and woken when a
request would wait longer behind the ready ones than the wake takes.

Resting. An instance that has run nothing for ``spare_idle_timeout`` (since its last request
ended, or since it became ready if later), while another instance of its deployment is ready,
is parked alone (stopped, where a park is a stop): the memory budget counts its parked memory
from then, and the deployment serves on. One at a time per deployment, and one instance always
stays ready. Its gate shuts in the same step that found it idle (no await between), so no
request is charged to it after; one with cut requests still unsettled is left up.

Waking or queueing. A request for a deployment with a rested spare decides before it is
offered: it goes to the ready instances (waiting in an engine's queue, if it must), or it wakes
the spare, waits for the wake to end, and then goes to the least loaded instance (the woken one,
unless another freed up meanwhile). The expected wait on a ready instance is nothing while its
engine has room (none waiting, slot or cache usage under 100 %); on a full engine, the requests
ahead (its waiting ones, or the gateway's own in flight there beyond what it runs, if more) and
this one, times the instance's measured time per request, over the requests it runs at once.
The least of these is weighed against the spare's wake (or start), as last measured
(`Costs.back`; ``lifecycle.start_estimate`` until then): a longer wait wakes it. A wait that
cannot be priced (no fresh sample with both counts, no request completed there yet) queues: a
number nobody measured wakes no engine. A wake reserves its memory in the budget first, and
never switches another deployment out for it: without room, it queues. Requests that arrive
while a wake runs and would wait longer than a wake join it. The router line says which it
chose, the expected wait and the wake (`Spare`).

A spare that failed to wake (or start) stays a spare: a later request that would wait longer
than its start starts it afresh, once the crash backoff since its failure is over (a failed
wake counts as a failed start: the first is tried again at once, then 1 s, 2 s, ... up to
60 s); a spare at rest is woken before a failed one. A request that no instance takes decides
again (`place`): it waits for an instance only until the backoff is over (`Spare.again_s`),
or until a spare's park under way ends.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from math import inf
from typing import TYPE_CHECKING

from .._clock import stamp
from .._deployments.routes import EngineInstance
from .._errors import EngineControlError, GatewayError
from .crash import backoff_left
from .states import DeploymentLife, InstanceState, Launched

if TYPE_CHECKING:
    from .controller import Lifecycle

__all__ = ["Spare", "expected_wait", "rest_idle", "wake_or_queue"]

logger = logging.getLogger("capyctl_gateway")
AT_REST = (InstanceState.PARKED, InstanceState.STOPPED)
DOWN = (*AT_REST, InstanceState.FAILED)
"""A spare that failed to wake (or start) is tried again, after the crash backoff."""


@dataclass(frozen=True, slots=True)
class Spare:
    """What a request did about its deployment's rested spare (what its router line says)."""

    chose: str
    """``wake`` (it woke the spare, or joined its wake) or ``queue`` (the ready ones)."""
    wait_s: float | None
    """The expected wait on the ready instances (None: not measured; ``inf``: none of them
    takes requests)."""
    wake_s: float
    """The spare's wake (or start), as last measured."""
    why: str
    wake: asyncio.Task[None] | None = None
    """The wake it waits for."""
    again_s: float | None = None
    """How long until the failed spare may be tried again (its crash backoff)."""

    def row(self) -> dict[str, object]:
        """The router line's ``spare`` field."""
        wait = None if self.wait_s is None or self.wait_s == inf else round(self.wait_s, 3)
        return {
            "chose": self.chose,
            "why": self.why,
            "wait_s": wait,
            "wake_s": round(self.wake_s, 3),
        }


def rest_idle(lifecycle: Lifecycle, life: DeploymentLife, now: float) -> None:
    """Park the longest idle spare of ``life``, where one is due (see the module's text)."""
    after = life.deployment.lifecycle.spare_idle_timeout
    if after is None or life.spare is not None or not life.serves_now or life.activating:
        return
    ready = [lc for lc in life.launched if _serves(lc)]  # another must serve on: it takes them
    idle = {lc: now - max(lc.inst.ledger.quiet_since, lc.since) for lc in ready}
    due = [lc for lc in ready if lc.inst.ledger.charged == 0 and idle[lc] >= after]
    if len(ready) < 2 or not due:
        return
    lc = max(due, key=lambda lc: idle[lc])
    why = f"a spare: idle for lifecycle.spare_idle_timeout ({after:g} s) while another serves"
    lc.inst.set_open(admitting=False, why=why)  # nothing is charged to it from now on
    lc.rested = True
    what = f"resting {lc.inst.where} (a spare)"
    life.spare = lifecycle.tasks.spawn(_rest(lifecycle, life, lc, why), kind="spare", what=what)


async def _rest(lifecycle: Lifecycle, life: DeploymentLife, lc: Launched, why: str) -> None:
    try:
        if life.parks:
            await lifecycle.engines.park(lc, why)
        else:
            await lifecycle.engines.stop_one(lc, f"{why} (a stop here)")
    finally:
        life.spare = None
        life.route.waiters.notify()  # one that waited while it parked may wake it now


def wake_or_queue(lifecycle: Lifecycle, name: str) -> Spare | None:
    """What a request for deployment ``name`` does about a rested spare (see the module's
    text); None where it has none, or serves nothing now (its activation is the lifecycle's)."""
    life = lifecycle.lives.get(name)
    if life is None or not life.serves_now:
        return None
    rested = [lc for lc in life.launched if lc.rested and lc.state in DOWN]
    if not rested and life.waking is None:
        return None
    waking, costs, wait = life.waking, lifecycle.scheduler.costs, _least_wait(life)
    first = [waking] if waking is not None else rested  # the one it wakes, or would
    asleep = any(lc.state in (InstanceState.PARKED, InstanceState.WAKING) for lc in first)
    wake_s = costs.back(life) if asleep else costs.start(life)  # stopped or failed: a start
    if wait is None:
        return Spare("queue", None, wake_s, "the ready instances' wait is not measured yet")
    if wait <= wake_s:
        return Spare("queue", wait, wake_s, "the wait is shorter than the wake")
    if life.spare is not None:
        if life.waking is not None:
            return Spare("wake", wait, wake_s, "joined the spare's wake", life.spare)
        return Spare("queue", wait, wake_s, "a spare is being parked")
    up = [lc for lc in rested if lc.inst.runner.cannot_start() is None]
    if not up:
        return Spare("queue", wait, wake_s, "no spare can be woken now")
    now = stamp()
    due = sorted((lc for lc in up if backoff_left(lc, now) == 0), key=_failed)
    if not due:  # each failed to come up lately: the crash backoff before the next try
        left = min(backoff_left(lc, now) for lc in up)
        why = f"the spare failed to come up; next try in {left:.1f} s"
        return Spare("queue", wait, wake_s, why, again_s=left)
    lc = due[0]  # one at rest before one that failed
    parked = lc.state is InstanceState.PARKED
    if not lifecycle.budget.reserve(life, [] if parked else [lc], [lc] if parked else []):
        return Spare("queue", wait, wake_s, "the memory budget has no room for the spare")
    what, life.waking = f"waking {lc.inst.where} (a spare)", lc
    life.spare = lifecycle.tasks.spawn(_wake(lifecycle, life, lc), kind="spare", what=what)
    why = f"woke instance {lc.inst.index}" + (
        ": no ready one takes requests" if wait == inf else ""
    )
    return Spare("wake", wait, wake_s, why, life.spare)


def _failed(lc: Launched) -> bool:
    return lc.state is InstanceState.FAILED


def _serves(lc: Launched) -> bool:
    """Whether ``lc`` is ready and takes requests now (its host reachable, its checks passed)."""
    return lc.state is InstanceState.READY and lc.inst.available and not lc.inst.unusable


def _least_wait(life: DeploymentLife) -> float | None:
    """The least expected wait over ``life``'s instances that take requests now: None where
    one of them cannot be priced, ``inf`` where none takes requests."""
    waits = [expected_wait(lc.inst) for lc in life.launched if _serves(lc)]
    if None in waits:
        return None
    return min((w for w in waits if w is not None), default=inf)


async def _wake(lifecycle: Lifecycle, life: DeploymentLife, lc: Launched) -> None:
    why = "a spare woken: a request would wait longer behind the ready instances"
    try:
        if lc.state is InstanceState.PARKED:
            await lifecycle.engines.wake(lc, why)
        else:
            await lifecycle.engines.start(lc, why)
    except (EngineControlError, GatewayError) as exc:  # its memory is given back as it ends
        logger.warning("%s: the spare did not come up (%s)", lc.inst.where, exc)
    finally:
        life.spare = life.waking = None


def expected_wait(inst: EngineInstance) -> float | None:
    """How long a request sent to ``inst`` now is likely to wait for the engine to run it (see
    the module's text); None where it cannot be priced."""
    sample, per = inst.runner.sample(), inst.ledger.per_request_s
    if sample is None or sample.running is None or sample.waiting is None or per is None:
        return None
    full = sample.waiting > 0 or (sample.usage is not None and sample.usage >= 1.0)
    if not full:
        return 0.0
    ahead = max(sample.waiting, inst.ledger.running - sample.running)
    return (ahead + 1) * per / max(sample.running, 1.0)
