"""Where an instance's engine runs: the one seam between the gateway and a machine.

A `Runner` is made once per instance when the routes are built, by the registry of runner
kinds (``_runners.py``, the only module that knows the kinds), and everything that differs
between an engine on this machine and one on a host goes through it. It has two faces:

- `Driver`, used by the lifecycle's transitions: start, park, wake, stop, and the exits and
  silences of a running engine;
- `View`, used by routing, ``status``, the console and the watches: its `Site` (where it runs
  as the rest of the gateway may know it: the memory pool it counts against, the machine's
  name, who proves its stops), its load as one `LoadSample`, its process, its log, and the
  exchanges in flight (a host that goes away ends them at once).

Nothing outside a runner's room tests a runner's type or asks for its host: what it needs to
know is on the `Site`. The local runner (``_local/``) runs a process and reads the collector;
the host runner (``_machines/runner.py``) sends orders to the host and reads its reports.

Never imports the HTTP surface, the relay, the lifecycle or the runner rooms.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._errors import EngineControlError
from .warm import WarmShown

__all__ = [
    "HERE",
    "CacheCounts",
    "Described",
    "Driver",
    "EngineControlError",
    "LoadSample",
    "LogLines",
    "ProcessView",
    "Reported",
    "Runner",
    "Shown",
    "Site",
    "Tracked",
    "View",
    "never",
]


@dataclass(frozen=True, slots=True)
class Site:
    """Where an engine runs, as everything outside its runner's room may know it."""

    pool: str
    """The memory pool its ``memory:`` counts against (`HERE`'s, or a host's name):
    the budget is kept per pool."""
    machine: str | None
    """The name of the machine it runs on where its runner knows it (a host's name), for the
    router line and ``status``; None where its address says (this machine's engines, and
    engines someone else runs)."""
    on: str
    """Where it runs, for log lines (``on host gpu-1``); empty for this machine."""
    stopper: str
    """Who proves its stops, as a settled cut request says (``the gateway``, ``its host``)."""
    outlives_gateway: bool
    """Whether the engine keeps running when this gateway stops (a host's does: a server
    that comes back finds it as it was)."""
    run_by: str = "the gateway (launch)"
    """Who runs a launched engine there, as ``list`` says it."""
    reported: str | None = None
    """Why nothing reaches the engine until where it runs reports it (a host's first report
    opens its gate: requests wait for it, as after a lost session, instead of failing on an
    address never given); None where it is reached as soon as it has an address."""

    def said(self, reason: str) -> str:
        """``reason``, with where it happened when that is not this machine."""
        return f"{reason} ({self.on})" if self.on else reason


HERE = Site(pool="this machine", machine=None, on="", stopper="the gateway", outlives_gateway=False)
"""The site of every engine on the gateway's own machine."""


@dataclass(frozen=True, slots=True)
class LoadSample:
    """An engine's load as one fresh sample says it: what routing weighs, what the router log
    line, ``status`` and a host's report show. A number the engine did not report is None."""

    running: float | None
    waiting: float | None
    usage: float | None
    """KV-cache usage (0..1), or slot usage for engines that have slots instead."""
    age_s: float
    """How old the sample is now."""
    source: str
    """Where it came from: ``collector`` (this machine) or ``host <name>``."""

    @property
    def counted(self) -> bool:
        """Whether the engine reported both its running and its waiting requests."""
        return self.running is not None and self.waiting is not None


@dataclass(frozen=True, slots=True)
class CacheCounts:
    """An engine's own prefix-cache counts, since it started: prompt tokens it looked up and,
    of those, the tokens it found cached."""

    queried_tokens: int
    hit_tokens: int

    def row(self) -> dict[str, int]:
        return {"queried_tokens": self.queried_tokens, "hit_tokens": self.hit_tokens}


@dataclass(frozen=True, slots=True)
class Shown:
    """One line of what ``status``, ``list`` and the console show under an instance beyond what
    every instance has (a pod and where it runs, a watch that is down, a delete owed)."""

    name: str
    """What the line is about (``pod``, ``pod_watch``): the console marks its row with it."""
    text: str
    alarm: bool = False
    """Whether it says something is wrong (the console shows it as a failure)."""


@dataclass(frozen=True, slots=True)
class Described:
    """An engine as its runner sees it: what ``status``, ``list`` and the console show, typed,
    so that none of them knows which kind of runner it is."""

    watched: str | None = None
    """What watches the engine says of it (the collector's or its host's state: ``ready``,
    ``connecting``, ``failed``, ...); None where nothing watches it yet."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    """Its fields in ``status``'s JSON (load and ages, a host's session, a pod; ``state`` is
    `watched`)."""
    lines: tuple[Shown, ...] = ()
    """What is printed under the instance (``status``, and ``list`` where it says where)."""
    link: str | None = None
    """The gateway's link to where it runs (a host's session: ``live``, ``lost``); None where
    there is none."""
    placed: str | None = None
    """Where it runs now, in a line of ``list`` (a pod, its node and phase); None where the
    instance's machine says it."""
    warm: WarmShown | None = None
    """What its warm cache saved and restored (``_deployments/warm.py``); None where its
    runner keeps none."""


@dataclass(frozen=True, slots=True)
class ProcessView:
    """The engine process as ``status`` shows it."""

    pid: int | None
    """The engine's own pid (None when it could not be seen)."""
    port: int | None
    argv: list[str]
    reaper_pid: int | None = None
    """The pid of the engine's keeper on this machine (``_local/reaper.py``)."""


class Tracked(Protocol):
    """What a runner may end from outside: an exchange in flight."""

    def abortable(self) -> None: ...

    def abort(self, why: str, code: str = "engine_error") -> None:
        """End it now; its client hears ``why`` with ``code`` (`ended_by_gateway`)."""
        ...


class LogLines(Protocol):
    """An engine's own log as the gateway shows it (masked)."""

    async def lines(self, count: int, max_bytes: int) -> list[str]:
        """Its last ``count`` lines, within ``max_bytes``."""
        ...


class View(Protocol):
    """What routing, ``status``, the console and the watches read of an engine."""

    @property
    def site(self) -> Site: ...

    def sample(self) -> LoadSample | None:
        """The engine's load from a fresh sample; None without one."""
        ...

    def stale(self) -> bool:
        """Whether the engine has no fresh sample once its first look since it started is over
        (its samples aged, its polls failed). False while that first look runs: an engine
        just started is not suspect."""
        ...

    def prefix_cache(self) -> CacheCounts | None:
        """The engine's own prefix-cache counts as its latest sample has them, however old;
        None where it publishes none (or not both)."""
        ...

    def process(self) -> ProcessView | None:
        """The running engine process, when the gateway runs it."""
        ...

    def describe(self) -> Described:
        """The engine as this runner sees it (its state, load and their ages; a host's session
        and ingress; a pod)."""
        ...

    def holdup(self) -> str | None:
        """Why its engine is not up yet, where its runner knows more than "starting" (a pod the
        scheduler cannot place); None otherwise. Requests that waited for it in vain hear it."""
        ...

    def why_unreachable(self) -> str:
        """Why requests cannot reach its machine (``host_session_lost``, ``dispatch_closed``)."""
        ...

    def log(self) -> LogLines | None:
        """The engine's own log here; None when it never ran. Raises GatewayError (409
        ``log_on_host``) where the log is kept on another machine."""
        ...

    def begin(self, exchange: Tracked) -> None:
        """An exchange with the engine starts (a host runner ends it if its host goes)."""
        ...

    def end(self, exchange: Tracked) -> None: ...


class Driver(Protocol):
    """What the lifecycle's transitions and watches do to an engine."""

    def cannot_start(self) -> str | None:
        """Why a start cannot begin now (what it needs cannot be reached: a cluster's API), for
        clients too; None when it can. Nothing is switched out for a start that cannot begin."""
        ...

    async def start(self, reason: str) -> str:
        """Start the engine; once it answers, say how (for the log). Raises
        EngineControlError (``lingers`` when an engine it made may still hold its memory)."""
        ...

    async def park(self, reason: str) -> None:
        """Park it with its process up. Raises EngineControlError."""
        ...

    async def wake(self, reason: str) -> None:
        """Wake a parked engine. Raises EngineControlError."""
        ...

    async def stop(self, reason: str) -> bool:
        """Stop it; whether the stop is proven (a proven stop settles its cut requests)."""
        ...

    def exited(self) -> str | None:
        """Why a running engine is gone without being asked to stop; None while it runs."""
        ...

    def silent_s(self) -> float | None:
        """How long the engine has answered none of its polls; None while it answers, or
        where nothing on this machine polls it (a host watches its own)."""
        ...

    async def gone(self) -> str:
        """Return, saying why, once the running engine has exited without being asked to stop
        (at once, not at the next look); a runner told of exits another way (a host's reports)
        never returns."""
        ...


class Runner(Driver, View, Protocol):
    """Where one instance's engine runs, and how the gateway drives and reads it."""


class Reported:
    """For a runner whose engine's exits and silences reach the lifecycle another way (a
    host's reports): `Runner.silent_s` and `Runner.gone` say nothing, ever."""

    def silent_s(self) -> float | None:
        return None

    async def gone(self) -> str:
        return await never()


async def never() -> str:
    """Wait for ever (until cancelled): what `Runner.gone` does when nothing will be said."""
    await asyncio.get_running_loop().create_future()  # never resolved
    raise AssertionError("unreachable")
