"""When a deployment that holds memory is switched out for one whose requests wait.

The lifecycle asks while an activation waits for room in a pool (``_lifecycle/budget.py``);
the answer is a `Switch` (this one, now, for this reason), a `Wait` (until this time, or until
something changes: a request ends, a transition, a switch under way), or nothing (no deployment
the policy may switch out; the lifecycle then waits for what is under way, or refuses).

``resources.switching``:

- ``cost_aware`` (the default). A resident deployment keeps serving while its requests keep
  coming, and is switched out for a waiting one when what waits outweighs what staying saves:

  - at once when it is idle and has been longer than its clients pause between requests:
    three times its quiet spells' moving average (`DeploymentQueue.gap`), at least
    `MIN_IDLE_S` (0.5 s), 2 s while none has been measured, and never longer than the switch
    costs (staying resident while idle is worth at most one switch). A closed-loop client's
    next request, which comes within moments, still finds it in; one that paused longer than
    its clients do has gone quiet;
  - when the oldest waiting request has waited ``resources.switch_patience`` (2) times the
    switch's cost (`Costs.switch`: the resident one's drain and park or stop, the waiting
    one's start or wake, as last measured; ``lifecycle.start_estimate``, 10 s, until then);
  - at ``resources.max_switch_wait`` (30 s) of waiting, whatever the resident one is doing
    (the fairness bound: no deployment starves, and requests waiting for the one switched out
    then wait under the same rule).

  Of several that may go, the idle before the busy; of the idle, the one whose clients are
  likely to miss it least (its way out and back in over how long they are likely to leave it
  alone: `_regret`), of the busy the one whose switch costs least; then the lowest
  ``lifecycle.priority`` (the higher number), then the longest unused. The one first in that
  order is the one that goes (once idle past its grace, or at the patience or the bound). Of
  several deployments waiting for the same pool, the lower ``lifecycle.priority`` goes first,
  then the one waiting longest (the fairness bound aside, which each reaches alike).
  An activation with no request waiting (an operator's start, a deployment kept ready) is not
  kept waiting: it switches as ``on_arrival`` does. One that only requests asked for, all of
  which have left (hung up, or reached their deadline), is never asked: it ends without a
  switch (``_lifecycle/room.py``).
- ``on_arrival``: switch as soon as one may go (idle first, never one with requests waiting:
  the gateway before the scheduler). Two deployments taking turns switch on every turn.
- ``collate``: switch as soon as the resident one has nothing running or waiting, never
  sooner; nothing is kept resident (llama-swap's collation, for comparison).

Every switch, by its reason, is counted (`REASONS`: ``capyctl_switches_total``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .._lifecycle.states import DeploymentLife, InstanceState
from .costs import Costs

__all__ = ["REASONS", "Switch", "Wait", "decide", "grace"]

REASONS = ("idle", "waited", "fairness", "on_arrival", "collate", "asked")
"""Why a deployment was switched out (a fixed set: a metric's label)."""
MIN_IDLE_S = 0.5
"""The least a busy deployment's idle spell lasts before it counts as gone quiet."""
IDLE_GAPS = 3.0
"""How many of its clients' usual pauses make it gone quiet."""
UNMEASURED_IDLE_S = 2.0
"""Gone quiet after this long, while its clients' pauses have not been measured."""


@dataclass(frozen=True, slots=True)
class Switch:
    out: DeploymentLife
    reason: str
    """One of `REASONS`."""
    why: str
    """For the log."""


@dataclass(frozen=True, slots=True)
class Wait:
    until: float | None
    """When to ask again at the latest (``_clock.stamp``); None: once something changes."""
    why: str
    out: DeploymentLife | None = None
    """The deployment it means to switch out then."""
    watch: tuple[DeploymentLife, ...] = ()
    """Deployments whose turning quiet or busy changes the answer: ask again when one does."""
    after: DeploymentLife | None = None
    """A deployment waiting for the same pool that goes first: ask again once its activation
    ends (it came in, or stopped waiting)."""


def _idle(life: DeploymentLife) -> bool:
    return life.route.queue.quiet


def _rank(
    life: DeploymentLife, into: DeploymentLife, costs: Costs, now: float
) -> tuple[bool, float, int, float]:
    """The order in which resident deployments go: the idle before the busy; of the idle, the
    one whose leaving costs least over the time it is likely to be left alone (`_regret`); of
    the busy, the cheapest switch; then the higher ``lifecycle.priority`` number, then the
    longest unused."""
    queue = life.route.queue
    idle = _idle(life)
    return (
        not idle,
        _regret(life, costs, now) if idle else costs.switch(life, into),
        -life.deployment.lifecycle.priority,
        queue.idle_since if idle else float("inf"),
    )


def _regret(life: DeploymentLife, costs: Costs, now: float) -> float:
    """What taking idle ``life`` out is likely to cost its own clients, per second: its way
    out and back in (`Costs.down`, `Costs.back`) over how long its clients are likely to leave
    it alone (their usual pause, or its idle spell so far if longer: the busiest deployment's
    clients come back soonest, one unused for minutes least likely to be asked for)."""
    queue = life.route.queue
    alone = max(queue.gap or 0.0, now - queue.idle_since, MIN_IDLE_S)
    return (costs.down(life) + costs.back(life)) / alone


def decide(
    policy: str,
    into: DeploymentLife,
    candidates: list[DeploymentLife],
    waiting: list[DeploymentLife],
    costs: Costs,
    now: float,
    *,
    patience: float,
    max_wait: float,
) -> Switch | Wait | None:
    """Whether to switch one of ``candidates`` (resident deployments the policy may take out)
    out for ``into`` now. ``waiting``: every deployment waiting for room in the same pool,
    ``into`` among them. None when no candidate may go."""
    if not candidates:
        return None
    oldest = into.route.queue.oldest
    if policy == "on_arrival" or oldest is None:
        may = [c for c in candidates if c.route.queue.waiting == 0]
        if not may:
            return None
        out = min(may, key=lambda c: (not _idle(c), c.route.queue.idle_since))
        reason = "on_arrival" if policy == "on_arrival" else "asked"
        return Switch(out, reason, f"for deployment {into.deployment.name}")
    if policy == "collate":
        idle = [c for c in candidates if _idle(c)]
        if idle:
            return Switch(idle[0], "collate", "it has nothing to do")
        return Wait(None, "the resident deployments have work", watch=tuple(candidates))
    waited = now - oldest
    ahead = _ahead(into, waiting)
    if ahead is not None and waited < max_wait:
        return Wait(
            oldest + max_wait, f"deployment {ahead.deployment.name} goes first", after=ahead
        )
    ranked = sorted(candidates, key=lambda c: _rank(c, into, costs, now))
    out = ranked[0]
    cost = costs.switch(out, into)
    quiet = _quiet_until(out, cost) if _idle(out) else float("inf")
    if now >= quiet:
        return Switch(out, "idle", f"idle for {now - out.route.queue.idle_since:.1f} s")
    if waited >= max_wait:
        return Switch(out, "fairness", f"a request waited {waited:.1f} s")
    if waited >= patience * cost:
        return Switch(out, "waited", f"a request waited {waited:.1f} s, {patience:g}x the switch")
    due = min(oldest + patience * cost, oldest + max_wait, quiet)
    doing = "is idle" if _idle(out) else "has work"
    why = f"deployment {out.deployment.name} {doing}; the switch costs {cost:.1f} s"
    return Wait(due, why, out, watch=tuple(ranked))


def _quiet_until(life: DeploymentLife, cost: float) -> float:
    """When idle ``life`` has gone quiet (`grace` after its idle spell began)."""
    return life.route.queue.idle_since + grace(life, cost)


def grace(life: DeploymentLife, cost: float) -> float:
    """How long ``life`` may be idle before it has gone quiet (see the module's text)."""
    gap = life.route.queue.gap
    usual = UNMEASURED_IDLE_S if gap is None else max(MIN_IDLE_S, IDLE_GAPS * gap)
    return min(cost, usual)


def _ahead(into: DeploymentLife, waiting: list[DeploymentLife]) -> DeploymentLife | None:
    """A deployment waiting for the same pool that goes before ``into`` (a lower priority, or
    the same and an older request)."""

    def key(life: DeploymentLife) -> tuple[int, float]:
        return life.deployment.lifecycle.priority, life.route.queue.oldest or float("inf")

    first = min(waiting, key=key, default=None)
    return first if first is not None and first is not into and key(first) < key(into) else None


def up(life: DeploymentLife) -> bool:
    """Whether ``life`` holds an engine a switch would take out (ready or parked)."""
    return any(lc.state in (InstanceState.READY, InstanceState.PARKED) for lc in life.launched)
