"""Which instance a request is offered to: where its prefix is cached, unless that instance is
busier than the least loaded by more than the deployment's ``routing.load_margin``.

The policy, in order:

1. The instances that may take the request now, in this request's turn (`Route.in_turn`:
   ties rotate; resting instances only when no other can take it).
2. Staleness: an instance whose samples went quiet (`View.stale`: sampled since its engine
   started, no fresh sample now) is passed over only while one with a fresh sample can take
   the request. A lone instance, or a set of instances that all went quiet, is never blocked
   for it; an engine not sampled yet since it started is not suspect. Without a fresh sample
   an instance's load is the gateway's own requests in flight there, never a zero read as
   idle.
3. Load is `load_of`: the engine's running and waiting requests, never under the gateway's
   own in flight there, plus up to 8 for a nearly full KV cache or slot set.
4. Among the instances whose requests (`requests_of`: the load without the cache's penalty)
   are within ``load_margin`` of the fewest, the one holding the most
   leading blocks of the request's prefix (`PrefixIndex.match`); ties go to the lower load,
   then the turn. Where only busier ones hold a block, the least loaded. Where none holds a
   block at all (a prompt start not seen yet), the one among them whose cache holds the fewest
   distinct prompt starts (`PrefixIndex.starts`; then the lower load, then the turn), so that
   tenants spread over the engines' caches rather than pile onto one by the accident of which
   was idle when each first came.

A deployment with ``routing.policy: least_load`` (or one instance, or a request with no full
block of prompt) skips step 4.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._deployments.routes import EngineInstance, Facts, Route, load_of, offerable, requests_of
from .._deployments.runner import LoadSample

__all__ = ["Choice", "choose"]


@dataclass(slots=True)
class Choice:
    """An instance chosen for a request, and why (what the router line says). Nobody changes
    one; it is not frozen for what that costs, once a request: a frozen dataclass sets each
    field through ``object.__setattr__``, about 6,000 instructions more."""

    instance: EngineInstance
    why: str
    """``prefix``: it holds the longest cached prefix of any instance; ``load_margin``: an
    instance holding more of it was busier than the margin allows (this is the least loaded);
    ``least_cached``: none holds a block of it, and this one holds the fewest prompt starts
    within the margin;
    ``least_load``: the deployment routes by load alone (or the request has no full block)."""
    matched: dict[int, int]
    """Leading blocks of the prefix each instance holds (those holding one)."""
    stale: frozenset[int]
    """Instances passed over for a stale load sample while a fresh one could take it."""
    samples: dict[int, LoadSample | None] = field(default_factory=dict)
    """The samples the choice weighed, by instance (what the router line shows)."""


def choose(route: Route, facts: Facts, exclude: set[int] | frozenset[int]) -> Choice | None:
    """The instance to offer a request with ``facts`` to, or None while none may take it."""
    if len(route.instances) == 1:
        only = route.instances[0]
        return Choice(only, "least_load", {}, frozenset()) if offerable(only, exclude) else None
    ordered = route.in_turn(exclude)
    samples = {i.index: i.runner.sample() for i in ordered}
    stale: frozenset[int] = frozenset()
    if any(s is not None for s in samples.values()):
        stale = frozenset(i.index for i in ordered if samples[i.index] is None and i.runner.stale())
        ordered = [i for i in ordered if i.index not in stale]
    if not ordered:
        return None
    loads = {i.index: load_of(i, samples[i.index]) for i in ordered}
    least = min(ordered, key=lambda i: loads[i.index])
    index = route.prefixes
    if index is None or not facts.prefix:
        return Choice(least, "least_load", {}, stale, samples)
    matched = index.match(facts.prefix)
    # The margin counts requests: a full slot set's penalty would move every prefix off an
    # engine of two slots the moment both are busy, and a miss elsewhere costs a prefill.
    counts = {i.index: requests_of(i, samples[i.index]) for i in ordered}
    ceiling = min(counts.values()) + route.deployment.routing.load_margin
    near = [i for i in ordered if counts[i.index] <= ceiling]
    holding = [i for i in near if matched.get(i.index)]
    if not holding:
        if any(matched.get(i.index) for i in ordered):  # its holders are all too busy
            return Choice(least, "load_margin", matched, stale, samples)
        roomiest = min(near, key=lambda i: (index.starts(i.index), loads[i.index]))
        return Choice(roomiest, "least_cached", matched, stale, samples)
    best = max(holding, key=lambda i: (matched[i.index], -loads[i.index]))
    longest = max(matched.get(i.index, 0) for i in ordered)
    why = "prefix" if matched[best.index] == longest else "load_margin"
    return Choice(best, why, matched, stale, samples)
