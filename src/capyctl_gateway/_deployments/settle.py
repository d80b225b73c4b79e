"""Requests an instance is charged with, and settling the ones that were cut short.

Closing the engine connection asks the engine to stop; it does not prove it did. A cut request
therefore stays charged to its instance until the collector shows the engine stopped:

* if the engine had already answered (generated text, or an error), at the first sample taken
  after the cut in which the engine reports nothing running and nothing waiting;
* if it had not (cut before the first token), at the engine's next stop or restart, on this
  machine and on a host alike: an engine that never started the request could still start
  it after looking idle. A restart is proven by a new process start marker, by a cumulative
  counter that went down, or by an absence (health failing) longer than a poll's timeout
  before the engine answered again (where the engine publishes no start marker); one failed
  poll, a timeout, is not proof (`Restart`).

While an instance has cut requests, the collector polls it every 250 ms.

An instance counts at most `MAX_CUT` of them: an engine someone else runs (``url:``) may never
restart, and every hang-up before its first token would be counted for good. Past the bound the
oldest is let go (settled as `OVER_THE_BOUND`, a warning in the log): what it says of the
engine is the oldest and least likely to still hold.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from canopyx_provider import (
    ChecksCompleted,
    EngineRestarted,
    Event,
    ScrapeFailed,
    ScrapeSucceeded,
)

from .restart import ABSENCE_S, Restart

__all__ = [
    "CutRequest",
    "InstanceLedger",
    "Restart",
    "SettleRule",
    "Settled",
    "Settlement",
    "settle_remote",
]

logger = logging.getLogger(__name__)
FAST_POLL_MS = 250
MAX_CUT = 1024
"""Cut requests one instance counts at most (its ledger, `status`, the store)."""
OVER_THE_BOUND = f"let go: over {MAX_CUT} cut requests counted"


class SettleRule(StrEnum):
    WHEN_IDLE = "when the engine reports idle"
    AT_RESTART = "at the engine's next stop or restart"


@dataclass(frozen=True, slots=True)
class CutRequest:
    request_id: str
    cut_at: float
    """Wall-clock seconds when the gateway closed the engine connection."""
    rule: SettleRule
    reason: str


@dataclass(frozen=True, slots=True)
class Settled:
    """A cut request that was settled, and the evidence."""

    cut: CutRequest
    why: str
    at: float
    sample_requested_at: float | None
    """When the sample that settled it was requested (None for a restart)."""


SERVED_WEIGHT = 0.2
"""The weight of the latest request in `InstanceLedger.per_request_s`."""


@dataclass(eq=False)
class InstanceLedger:
    key: str
    running: int = 0
    cut: list[CutRequest] = field(default_factory=list)
    restart: Restart = field(default_factory=lambda: Restart())
    """What its samples prove of its engine's restarts."""
    stopped: str | None = None
    """Set while its engine is provably stopped (the settling reason, ``engine stopped by the
    gateway``), until its next start: a request whose end is heard only now (a worker's word
    that crossed the stop) was cut on an engine that runs nothing, and settles at once."""

    per_request_s: float | None = None
    """How long a request that completed here ran, as a moving average (None until one did):
    what a request's expected wait behind the engine's queue is priced by. Kept, with
    `quiet_since`, for timed instances only (`EngineInstance.timed`: a deployment with spares)."""
    quiet_since: float = 0.0
    """When its last running request ended (``_clock.stamp``)."""

    @property
    def charged(self) -> int:
        return self.running + len(self.cut)

    def ended(self, took: float | None, now: float) -> None:
        """A request charged here ended at ``now`` (``running`` already counts it out);
        ``took``: how long it ran, where it completed."""
        if took is not None:
            mean = self.per_request_s
            self.per_request_s = took if mean is None else mean + SERVED_WEIGHT * (took - mean)
        if self.running == 0:
            self.quiet_since = now


class Settlement:
    """Receives the collector's events and settles cut requests (an EventHook)."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        poll: Callable[[str, int | None], None],
        fast_poll_ms: int = FAST_POLL_MS,
        absence_s: float = ABSENCE_S,
        on_cut: Callable[[str, CutRequest], None] | None = None,
        on_settled: Callable[[str, list[CutRequest], str], None] | None = None,
    ) -> None:
        """``poll(key, interval_ms)`` sets an instance's polling interval (None: the default):
        settlement asks for faster samples while a cut request waits to be settled."""
        self._clock = clock
        self._poll = poll
        self._on_cut = on_cut
        self._on_settled = on_settled  # where cuts are kept to outlive the process (the store)
        self.fast_poll_ms = fast_poll_ms
        self.ledgers: dict[str, InstanceLedger] = {}
        self.settled = 0
        self.recent: deque[Settled] = deque(maxlen=256)  # the latest settlements, newest last
        self.observers: list[Callable[[Event], None]] = []
        """Called after each collector event has been applied (logging, tests)."""
        self.settled_observers: list[Callable[[str, list[CutRequest], str], None]] = []
        """Called with each batch of settled cut requests (tests)."""
        self.restart_observers: list[Callable[[str], None]] = []  # a key: its restart proven
        self.absence_s = absence_s  # an absence longer than this proves a restart (ABSENCE_S)

    def now(self) -> float:  # the settlement's clock (cut times are on it)
        return self._clock()

    def ledger(self, key: str) -> InstanceLedger:
        return self.ledgers.setdefault(key, InstanceLedger(key))

    def cut(
        self, ledger: InstanceLedger, request_id: str, *, answered: bool, reason: str
    ) -> CutRequest:
        rule = SettleRule.WHEN_IDLE if answered else SettleRule.AT_RESTART
        item = CutRequest(request_id, self._clock(), rule, reason)
        ledger.cut.append(item)
        if self._on_cut is not None:
            self._on_cut(ledger.key, item)
        self._poll(ledger.key, self.fast_poll_ms)
        why = f"{reason}; charged to {ledger.key} until settled {rule.value}"
        logger.info("request %s cut (%s)", request_id, why)
        if ledger.stopped is not None:  # its engine is gone already: nothing runs it
            self.settle_all(ledger, ledger.stopped)
        self._bound(ledger)
        return item

    def restore(self, ledger: InstanceLedger, cuts: list[CutRequest]) -> None:
        """Count again the cut requests a previous run of the gateway left unsettled."""
        ledger.cut.extend(cuts)
        if cuts:
            self._poll(ledger.key, self.fast_poll_ms)
        self._bound(ledger)

    def _bound(self, ledger: InstanceLedger) -> None:
        """Keep ``ledger`` within `MAX_CUT`: the oldest cut requests past it are let go."""
        if (over := len(ledger.cut) - MAX_CUT) > 0:
            oldest = {id(c) for c in ledger.cut[:over]}
            logger.warning("%s: %d cut request(s) %s", ledger.key, over, OVER_THE_BOUND)
            self.settle(ledger, lambda c: id(c) in oldest, OVER_THE_BOUND)

    def settle_all(self, ledger: InstanceLedger, why: str) -> None:
        """The engine was stopped by the gateway: nothing it counted can still run."""
        self.settle(ledger, lambda c: True, why)

    def __call__(self, event: Event, /) -> None:
        ledger = self.ledgers.get(event.key)
        if ledger is not None:
            self._by_event(ledger, event)
        for observer in self.observers:
            observer(event)

    def _by_event(self, ledger: InstanceLedger, event: Event) -> None:
        """A collector event of ``ledger``'s instance: a sample (idle, or one that proves a
        restart: `Restart`), a failed health check (noted), or a new process start marker."""
        match event:
            case ScrapeSucceeded(snapshot=snap):
                proof = ledger.restart.sampled(snap, self.absence_s)
                if proof is not None:  # the why is a metric's label: its figure is logged
                    gap = snap.requested_at - proof[0]
                    logger.info("%s: %s (%.1f s before this sample)", event.key, proof[1], gap)
                    self.restarted(ledger, *proof)
                idle = snap.metrics.idle is True
                if ledger.cut and idle:
                    self.settle(
                        ledger,
                        lambda c: c.rule is SettleRule.WHEN_IDLE and c.cut_at < snap.requested_at,
                        "engine idle",
                        sample_requested_at=snap.requested_at,
                    )
            case ScrapeFailed(check=check, at=at):
                if check == "health":
                    ledger.restart.down(at)
            case EngineRestarted():
                self.restarted(ledger, self.now(), "engine restarted")
            case ChecksCompleted():
                pass

    def restarted(self, ledger: InstanceLedger, before: float, why: str) -> None:
        """``ledger``'s engine restarted after ``before``: what was cut before is settled."""
        self.settle(ledger, lambda c: c.cut_at < before, why)
        for observe in self.restart_observers:
            observe(ledger.key)

    def settle(
        self,
        ledger: InstanceLedger,
        done: Callable[[CutRequest], bool],
        why: str,
        *,
        sample_requested_at: float | None = None,
    ) -> None:
        """Settle the cut requests of ``ledger`` that ``done`` picks, for ``why``."""
        keep: list[CutRequest] = []
        gone: list[CutRequest] = []
        for c in ledger.cut:
            (gone if done(c) else keep).append(c)
        if not gone:
            return
        now = self._clock()
        self.recent.extend(Settled(c, why, now, sample_requested_at) for c in gone)
        if self._on_settled is not None:
            self._on_settled(ledger.key, gone, why)
        for observe in self.settled_observers:
            observe(ledger.key, gone, why)
        ledger.cut = keep
        self.settled += len(gone)
        logger.info("%s: %d cut request(s) settled (%s)", ledger.key, len(gone), why)
        if not keep:
            self._poll(ledger.key, None)


# --- the evidence: what a collector event, or a host's report, settles --------------------------


def settle_remote(
    settlement: Settlement,
    ledger: InstanceLedger,
    *,
    idle_after: float | None,
    restarted_before: float | None,
) -> None:
    """A host's report on a remote instance: its ingress and engine were seen idle in a
    sample taken no earlier than ``idle_after``, or its engine restarted or stopped no earlier
    than ``restarted_before`` (both on the settlement's clock)."""
    if restarted_before is not None:
        settlement.settle(
            ledger, lambda c: c.cut_at < restarted_before, "engine restarted on its host"
        )
    if idle_after is not None:
        settlement.settle(
            ledger,
            lambda c: c.rule is SettleRule.WHEN_IDLE and c.cut_at < idle_after,
            "engine and ingress idle on its host",
            sample_requested_at=idle_after,
        )
