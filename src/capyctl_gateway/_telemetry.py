"""The gateway's own counts and timings, recorded cheaply on the hot path.

Recording a request is a few dictionary lookups, integer additions and one C-level bisect per
timing: no locks, no label resolution, no per-request allocation beyond the key tuples. The
Prometheus exposition (``_management/metrics.py``) reads these numbers at scrape time, where the
cost does not matter. Labels come from the configuration (deployment, instance), from the
gateway's fixed outcomes and its documented error codes, never from a client.

Imports nothing of the gateway's rooms.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

__all__ = [
    "BUCKETS",
    "CUTS",
    "OUTCOMES",
    "PHASES",
    "RECENT_SLOTS",
    "RECENT_SLOT_S",
    "Ending",
    "Histogram",
    "Recent",
    "Slot",
    "Telemetry",
]

BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
"""Seconds, for LLM traffic: a millisecond (a queue without wait, a cached head) to ten
minutes (the default request deadline)."""


class Ending(StrEnum):
    """How a request ended: the one vocabulary of the gateway's counts, logs and settlement,
    and the ``outcome`` label set of ``capyctl_requests_total``. An exchange with an engine
    writes it (`Outcome.ending`); a request refused before any exchange is `REFUSED`."""

    COMPLETED = "completed"
    ENGINE_ERROR = "engine_error"
    UNVERIFIED = "unverified"
    HANG_UP = "hang_up"
    DEADLINE = "deadline"
    IDLE_TIMEOUT = "idle_timeout"
    REFUSED = "refused"
    """The gateway refused it, or the engine did (its 4xx, relayed as ``engine_rejected``)."""


OUTCOMES = tuple(e.value for e in Ending)
CUTS = frozenset({Ending.HANG_UP, Ending.DEADLINE, Ending.IDLE_TIMEOUT})
"""The endings where the gateway cut the engine's work short (it may still run there)."""
PHASES = (
    "queue_wait", "activation_wait", "engine_first_byte", "first_content", "last_chunk", "total",
)  # fmt: skip
"""What each timing measures, from the request's arrival: the wait for a running slot; the wait
for a launched engine to start or wake; then, from the moment the request was sent to the
engine, its answer's head, its first content, its last chunk; and the whole request."""


@dataclass(slots=True)
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(BUCKETS, value)] += 1
        self.total += value


class Telemetry:
    """Counters and histograms keyed by (deployment, ...)."""

    __slots__ = ("requests", "refusals", "timings", "transitions", "settled", "recent")

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str, str]] = Counter()
        """(deployment, api, outcome) -> requests."""
        self.refusals: Counter[tuple[str, str]] = Counter()
        """(deployment or "", code) -> refused requests."""
        self.timings: dict[tuple[str, str], list[Histogram]] = {}
        """(deployment, instance) -> one histogram per phase, in `PHASES` order (seconds)."""
        self.transitions: Counter[tuple[str, str]] = Counter()
        """(deployment, to state) -> lifecycle transitions."""
        self.settled: Counter[tuple[str, str, str]] = Counter()
        """(deployment, instance, how) -> cut requests settled."""
        self.recent: dict[str, Recent] = {}
        """deployment -> its last few minutes (the console's figures)."""

    def phases(self, deployment: str, instance: str) -> list[Histogram]:
        """The histograms of (deployment, instance), indexed as `PHASES`."""
        key = (deployment, instance)
        found = self.timings.get(key)
        if found is None:
            found = self.timings[key] = [Histogram() for _ in PHASES]
        return found

    def window(self, deployment: str, now: float) -> Recent:
        """Deployment ``deployment``'s recent window (made at ``now`` on first use)."""
        found = self.recent.get(deployment)
        if found is None:
            found = self.recent[deployment] = Recent(now)
        return found


RECENT_SLOT_S = 10
"""The width of one slot of a deployment's recent window, in seconds."""
RECENT_SLOTS = 30
"""Slots in the window: the last five minutes."""


class Slot(NamedTuple):
    """One slot of a recent window: its seconds within the window, requests ended, errors,
    and the sums and counts of two timings, each over the requests that had one: the answers'
    own time to first token (their ``ttft_ms``) and the wait for a start or wake."""

    seconds: float
    requests: int
    errors: int
    ttft_sum: float
    ttft_n: int
    wake_sum: float
    wake_n: int


class Recent:
    """A deployment's last `RECENT_SLOTS` slots of `RECENT_SLOT_S` seconds: requests ended,
    errors, and the sum and count of the answers' times to first token and of the waits for a
    start or wake. A fixed ring: recording a request is a division, an index and a few
    additions; a slot is reused once its time has passed."""

    __slots__ = (
        "since", "slot", "requests", "errors", "ttft_sum", "ttft_n", "wake_sum", "wake_n",
    )  # fmt: skip

    def __init__(self, now: float) -> None:
        self.since = now
        """When the window began (loop time): it says nothing of the time before."""
        self.slot = [-1] * RECENT_SLOTS
        """The slot number (loop time // `RECENT_SLOT_S`) each ring entry holds now."""
        self.requests = [0] * RECENT_SLOTS
        self.errors = [0] * RECENT_SLOTS
        self.ttft_sum = [0.0] * RECENT_SLOTS
        self.ttft_n = [0] * RECENT_SLOTS
        self.wake_sum = [0.0] * RECENT_SLOTS
        self.wake_n = [0] * RECENT_SLOTS

    def add(self, now: float, error: bool, ttft: float | None, wake: float | None) -> None:
        """One request ended at ``now`` (loop time): an error or not, the time to first token
        its answer reported (None when it reported none) and its wait for a start or wake
        (None when it waited for none)."""
        n = int(now // RECENT_SLOT_S)
        i = n % RECENT_SLOTS
        if self.slot[i] != n:
            self.slot[i] = n
            self.requests[i] = self.errors[i] = self.ttft_n[i] = self.wake_n[i] = 0
            self.ttft_sum[i] = self.wake_sum[i] = 0.0
        self.requests[i] += 1
        if error:
            self.errors[i] += 1
        if ttft is not None:
            self.ttft_sum[i] += ttft
            self.ttft_n[i] += 1
        if wake is not None:
            self.wake_sum[i] += wake
            self.wake_n[i] += 1

    def slots(self, now: float) -> list[Slot]:
        """The window at ``now``, oldest slot first (the current slot's seconds are those so
        far; the first one's those since the window began). Slots before the window began are
        left out."""
        last = int(now // RECENT_SLOT_S)
        first = max(last - RECENT_SLOTS + 1, int(self.since // RECENT_SLOT_S))
        out: list[Slot] = []
        for n in range(first, last + 1):
            start = max(n * RECENT_SLOT_S, self.since)
            seconds = round(min((n + 1) * RECENT_SLOT_S, now) - start, 3)
            i = n % RECENT_SLOTS
            if self.slot[i] != n:
                out.append(Slot(seconds, 0, 0, 0.0, 0, 0.0, 0))
                continue
            out.append(
                Slot(
                    seconds,
                    self.requests[i],
                    self.errors[i],
                    self.ttft_sum[i],
                    self.ttft_n[i],
                    self.wake_sum[i],
                    self.wake_n[i],
                )
            )
        return out
