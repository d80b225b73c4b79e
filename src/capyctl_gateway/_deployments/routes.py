"""Deployments as the gateway serves them: their instances, queue and instance choice.

A `Route` is one deployment: its instances, its waiting queue, and the choice of the
instance a request is offered to. Load is the engine's own count of running and waiting
requests when a fresh sample has it, and never less than the requests the gateway has in
flight there. Cut requests still waiting to be settled are not load: they say what the engine
may still be doing and what memory stays counted, and an instance whose clients gave up early
must not be starved of traffic for it. An instance that provably never got a request (its
connection refused, its host's ingress busy) rests for `NOT_ACCEPTED_REST_S`: it is passed over
while another instance can take the request, then offered requests again.

Never imports the HTTP surface or the relay.
"""

from __future__ import annotations

import ipaddress
import itertools
import math
import socket
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from urllib.parse import urlsplit

from yarl import URL

from .._clock import stamp
from .._config import Deployment, Launch
from .._log import event
from .prefixes import PrefixIndex
from .queue import DeploymentQueue
from .runner import LoadSample, Runner, Tracked
from .settle import InstanceLedger
from .waiters import Waiters

__all__ = [
    "NOT_ACCEPTED_REST_S",
    "EngineInstance",
    "Facts",
    "Route",
    "Waiters",
    "load",
    "load_of",
    "requests_of",
    "machine_of",
    "offerable",
    "usage_penalty",
]

THIS_MACHINE = socket.gethostname() or "localhost"
"""This machine's name, as the router line names an engine that runs here."""

NOT_ACCEPTED_REST_S = 5.0
"""How long an instance that failed to accept a request (`NotAcceptedError`) is passed over
while another can take requests: long enough that a dead engine behind a live host is not
offered every request first, short enough that one back up is soon used again."""


@dataclass(frozen=True, slots=True)
class Facts:
    """What the chooser may weigh of a request, besides the instances' load: the model it asks
    for (the deployment's name), its ``cache_salt`` and its prompt's prefix fingerprints
    (``_routing/prefix.py``; the salt is folded into them, so one salt's prefix never matches
    another's), and its ``priority``."""

    model: str
    salt: str | None = None
    prefix: tuple[int, ...] = ()
    priority: int = 0
    """Its place in the deployment's queue (the lower first)."""


@dataclass(eq=False)
class EngineInstance:
    """One engine serving a deployment, as the gateway reaches it.

    Whether it takes requests (`available`) is derived from two facts, each changed only
    through `set_open`, which logs why and wakes the requests waiting for an instance: the
    lifecycle's (``admitting``: an engine someone else runs always admits; a launched one
    while it is ready and not being drained) and the runner's (``reachable``: a host's
    session is live and its gate open; always, on this machine).
    """

    deployment: str
    index: int
    url: str | None
    """None while a launched engine has no process (its address comes with its port)."""
    headers: dict[str, str] = field(repr=False)
    engine_key: str | None = field(repr=False)
    ledger: InstanceLedger
    waiters: Waiters = field(repr=False)
    runner_of: InitVar[Callable[[EngineInstance], Runner]]
    """Makes its runner, given the instance whole but for it (`__post_init__`)."""
    launch: Launch | None = None
    """How the gateway runs it; None for an engine someone else runs."""
    runner: Runner = field(init=False, repr=False)
    """Where its engine runs: made by ``runner_of`` as the instance is built, never replaced."""
    host: str = field(init=False, default="")
    machine: str = field(init=False, default=THIS_MACHINE)
    """The machine the engine runs on, as the router line names it: its host's name, this
    machine's name for an engine on loopback (or not yet bound), else the address's host."""
    where: str = field(init=False, default="")
    """How clients hear of it: never its address."""
    chat_url: URL = field(init=False, default=URL())
    decision_url: URL = field(init=False, default=URL())
    unusable: str | None = None
    """Why requests are not sent here (a startup check the engine failed: another model
    served, another version refused); None while it may be routed to."""
    admitting: bool = field(init=False, default=False)
    reachable: bool = field(init=False, default=True)
    inflight: set[Tracked] = field(init=False, default_factory=set, repr=False)
    """The exchanges charged to it now (`Charge`): what a stopping gateway ends."""
    opened: int = field(init=False, default=0)
    """How often it began to take requests (a request refused is offered again once grown)."""
    timed: bool = False
    """Its requests are timed (`InstanceLedger.ended`): a launched deployment with spares
    (``lifecycle.spare_idle_timeout``); others skip the clock reads."""
    restored: str | None = None
    """What its engine's warm cache restored when it last started (``1 prefix restored, 9333
    tokens``), until a request is placed on it: the router line of that request says so."""

    def __post_init__(self, runner_of: Callable[[EngineInstance], Runner]) -> None:
        self.where = f"deployment {self.deployment}, instance {self.index}"
        self.admitting = self.launch is None
        # The runner and its instance are a pair made in one step: the runner addresses the
        # instance (`bind`, `set_open`), the instance reads its engine through the runner.
        runner = self.runner = runner_of(self)
        self.host = runner.site.machine or ""
        self.machine = machine_of(runner.site.machine, None)
        if runner.site.reported is not None:
            self.set_open(reachable=False, why=runner.site.reported)
        if self.url is not None:
            self.bind(self.url)

    @property
    def available(self) -> bool:
        """Whether the engine can take requests now."""
        return self.admitting and self.reachable

    def set_open(
        self, *, admitting: bool | None = None, reachable: bool | None = None, why: str
    ) -> None:
        """The one way to change whether this instance takes requests."""
        before = self.available
        if admitting is not None:
            self.admitting = admitting
        if reachable is not None:
            self.reachable = reachable
        now = self.available
        if now is before:
            return
        event(
            "dispatch",
            "%s: %s (%s)",
            self.where,
            "takes requests" if now else "takes none",
            why,
            deployment=self.deployment,
            instance=self.index,
            state="open" if now else "closed",
            reason=why,
        )
        if now:
            self.opened += 1
        self.waiters.notify()  # either way: a request waiting for this one looks again

    def bind(self, url: str) -> None:
        """Address the instance at ``url`` (a launched engine, once it has its port; one on a
        host, at its host's ingress)."""
        self.url = url
        named = self.runner.site.machine
        self.host = named or urlsplit(url).hostname or ""
        self.machine = machine_of(named, url)
        # Parsed once: aiohttp would parse a string URL on every request.
        self.chat_url = URL(url + "/v1/chat/completions")
        self.decision_url = URL(url + "/v1/systemone")

    @property
    def key(self) -> str:
        """The collector's and the ledger's key: ``<deployment>/<index>``."""
        return self.ledger.key


def machine_of(named: str | None, url: str | None) -> str:
    """The machine an instance's engine runs on (`EngineInstance.machine`): the one its
    runner names, else the one its address names (this machine's name for loopback)."""
    if named is not None:
        return named
    name = urlsplit(url).hostname if url is not None else None
    if name is None or name == "localhost" or _loopback(name):
        return THIS_MACHINE
    return name


def _loopback(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def load_of(inst: EngineInstance, sample: LoadSample | None) -> int:
    """What routing weighs: the engine's running and waiting requests from a fresh sample,
    never less than the requests the gateway has in flight there, plus a penalty for a nearly
    full KV cache (or slot set); without such a sample, the requests in flight alone."""
    count = requests_of(inst, sample)
    return count if sample is None else count + usage_penalty(sample.usage)


def requests_of(inst: EngineInstance, sample: LoadSample | None) -> int:
    """The requests at ``inst``: the engine's running and waiting from a fresh sample, never
    less than the gateway's own in flight there (`load_of` without the cache's penalty)."""
    running = inst.ledger.running
    if sample is None or sample.running is None or sample.waiting is None:
        return running
    return max(running, int(sample.running + sample.waiting))


def load(inst: EngineInstance) -> int:
    return load_of(inst, inst.runner.sample())


@dataclass(eq=False)
class Route:
    deployment: Deployment
    instances: list[EngineInstance]
    queue: DeploymentQueue
    waiters: Waiters
    id: str
    """The deployment's short ID: stable across restarts (kept in the store), shown by
    ``status`` and ``list`` and named by the router line."""
    turn: itertools.count[int] = field(default_factory=itertools.count)
    clock: Callable[[], float] = stamp
    resting: dict[int, float] = field(default_factory=dict)
    """Instances that failed to accept a request, with when their rest ends."""
    prefixes: PrefixIndex | None = None
    """Which instance recently served which prompt prefixes (prefix routing, with several
    instances); None where the deployment routes by load alone."""
    _start: int = 0

    def not_accepted(self, inst: EngineInstance) -> None:
        """``inst`` provably never got a request: it rests for `NOT_ACCEPTED_REST_S`."""
        self.resting[inst.index] = self.clock() + NOT_ACCEPTED_REST_S

    def rest_left(self, inst: EngineInstance) -> float:
        """Seconds left of ``inst``'s rest; 0 when it has none."""
        left = self.resting.get(inst.index, -math.inf) - self.clock()
        if left <= 0:
            self.resting.pop(inst.index, None)
        return max(left, 0.0)

    def abort_running(self, why: str, code: str) -> int:
        """End every exchange in flight on the instances now (`Tracked.abort`); how many."""
        running = [ex for inst in self.instances for ex in inst.inflight]
        for ex in running:
            ex.abort(why, code)
        return len(running)

    def in_turn(self, exclude: set[int] | frozenset[int]) -> list[EngineInstance]:
        """The instances a request may be offered to now, in this request's turn: ties rotate,
        once per request (a failover keeps its turn); resting ones only when no other can
        take it."""
        if not exclude:
            self._start = next(self.turn) % len(self.instances)
        start = self._start
        ordered = [
            i for i in self.instances[start:] + self.instances[:start] if offerable(i, exclude)
        ]
        if self.resting:  # the clock is read only while an instance rests
            ordered = [i for i in ordered if not self.rest_left(i)] or ordered
        return ordered


def offerable(inst: EngineInstance, exclude: set[int] | frozenset[int]) -> bool:
    """Whether a request may be offered to ``inst``: not refused for it already, its startup
    checks passed, and it takes requests now."""
    return inst.index not in exclude and not inst.unusable and inst.available


def usage_penalty(usage: float | None) -> int:
    """What a nearly full KV cache (or slot set) adds to an instance's load: up to 8 from 80%."""
    if usage is None or usage <= 0.8:
        return 0
    return math.ceil((min(usage, 1.0) - 0.8) / 0.2 * 8)
