"""Requests an instance is charged with, and settling the ones that were cut short.

Closing the engine connection asks the engine to stop; it does not prove it did. A cut request
therefore stays charged to its instance until the collector shows the engine stopped:

* if the engine had already answered (generated text, or an error), at the first sample taken
  after the cut in which the engine reports nothing running and nothing waiting;
* if it had not (cut before the first token), at the engine's next stop or restart: a new
  process start marker, or its health check failing and then recovering after the cut. An
  engine that never started the request could still start it after looking idle.
* on a host, an engine someone else runs (``url:``) may never stop or restart: a request cut
  there before its first token (a partition, a host lost) settles also on a report whose
  sample shows the engine idle, taken after the cut and `QUIET_GRACE_S` after the ingress's
  last forward to it ended (its engine connection closed), with nothing in flight there.

While an instance has cut requests, the collector polls it every 250 ms.
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

__all__ = [
    "QUIET_GRACE_S",
    "CutRequest",
    "InstanceLedger",
    "SettleRule",
    "Settled",
    "Settlement",
    "settle_remote",
]

logger = logging.getLogger(__name__)
FAST_POLL_MS = 250
QUIET_GRACE_S = 5.0
"""How long before an idle sample a host's ingress must have ended its last forward to an
engine for that sample to settle a request cut there before its first token: time enough for
an engine to count a request whose connection was closed as it arrived."""


class SettleRule(StrEnum):
    WHEN_IDLE = "when the engine reports idle"
    AT_RESTART = "at the engine's next stop or restart"
    WHEN_QUIET_ON_HOST = (
        "when its host's ingress has been quiet for 5 s and the engine idle, "
        "or at the engine's next stop or restart"
    )


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


@dataclass(eq=False)
class InstanceLedger:
    key: str
    running: int = 0
    cut: list[CutRequest] = field(default_factory=list)
    down_since: float | None = None
    """When the engine's health check started failing (None while it answers)."""
    unanswered: SettleRule = SettleRule.AT_RESTART
    """The rule of a request cut before the engine answered (an engine someone else runs on
    a host: `SettleRule.WHEN_QUIET_ON_HOST`, set by its runner)."""
    stopped: str | None = None
    """Set while its engine is provably stopped (the settling reason, ``engine stopped by the
    gateway``), until its next start: a request whose end is heard only now (a worker's word
    that crossed the stop) was cut on an engine that runs nothing, and settles at once."""

    @property
    def charged(self) -> int:
        return self.running + len(self.cut)


class Settlement:
    """Receives the collector's events and settles cut requests (an EventHook)."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        poll: Callable[[str, int | None], None],
        fast_poll_ms: int = FAST_POLL_MS,
        on_cut: Callable[[str, CutRequest], None] | None = None,
        on_settled: Callable[[str, list[CutRequest], str], None] | None = None,
    ) -> None:
        """``poll(key, interval_ms)`` sets an instance's polling interval (None: the
        collector's default); it is how settlement asks for faster samples while a cut
        request waits to be settled."""
        self._clock = clock
        self._poll = poll
        self._on_cut = on_cut
        self._on_settled = on_settled
        """Where cut and settled requests are recorded to outlive the process (the store)."""
        self.fast_poll_ms = fast_poll_ms
        self.ledgers: dict[str, InstanceLedger] = {}
        self.settled = 0
        self.recent: deque[Settled] = deque(maxlen=256)
        """The latest settlements, newest last."""
        self.observers: list[Callable[[Event], None]] = []
        """Called after each collector event has been applied (logging, tests)."""
        self.settled_observers: list[Callable[[str, list[CutRequest], str], None]] = []
        """Called with each batch of settled cut requests (tests)."""

    def now(self) -> float:
        """The settlement's clock (cut times are on it)."""
        return self._clock()

    def ledger(self, key: str) -> InstanceLedger:
        return self.ledgers.setdefault(key, InstanceLedger(key))

    def cut(
        self, ledger: InstanceLedger, request_id: str, *, answered: bool, reason: str
    ) -> CutRequest:
        rule = SettleRule.WHEN_IDLE if answered else ledger.unanswered
        item = CutRequest(request_id, self._clock(), rule, reason)
        ledger.cut.append(item)
        if self._on_cut is not None:
            self._on_cut(ledger.key, item)
        self._poll(ledger.key, self.fast_poll_ms)
        logger.info(
            "request %s cut (%s); charged to %s until settled %s",
            request_id,
            reason,
            ledger.key,
            rule.value,
        )
        if ledger.stopped is not None:  # its engine is gone already: nothing runs it
            self.settle_all(ledger, ledger.stopped)
        return item

    def restore(self, ledger: InstanceLedger, cuts: list[CutRequest]) -> None:
        """Count again the cut requests a previous run of the gateway left unsettled."""
        ledger.cut.extend(cuts)
        if cuts:
            self._poll(ledger.key, self.fast_poll_ms)

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
        """A collector event of ``ledger``'s instance: an idle sample, a recovery from failed health
        checks, or a restart (a failed health check is noted for the recovery)."""
        match event:
            case ScrapeSucceeded(snapshot=snap):
                recovered_from = ledger.down_since
                ledger.down_since = None
                if not ledger.cut:
                    return
                idle = snap.metrics.idle is True
                self.settle(
                    ledger,
                    lambda c: (
                        (c.rule is SettleRule.WHEN_IDLE and idle and c.cut_at < snap.requested_at)
                        or (recovered_from is not None and c.cut_at < recovered_from)
                    ),
                    "engine recovered" if recovered_from is not None else "engine idle",
                    sample_requested_at=snap.requested_at,
                )
            case ScrapeFailed(check=check, at=at):
                if check == "health" and ledger.down_since is None:
                    ledger.down_since = at
            case EngineRestarted():
                now = self.now()
                self.settle(ledger, lambda c: c.cut_at < now, "engine restarted")
            case ChecksCompleted():
                pass

    def settle(
        self,
        ledger: InstanceLedger,
        done: Callable[[CutRequest], bool],
        why: str,
        *,
        sample_requested_at: float | None = None,
    ) -> None:
        """Settle the cut requests of ``ledger`` that ``done`` picks, for ``why`` (the
        evidence: the functions below)."""
        keep = [c for c in ledger.cut if not done(c)]
        gone = len(ledger.cut) - len(keep)
        if not gone:
            return
        now = self._clock()
        self.recent.extend(
            Settled(c, why, now, sample_requested_at) for c in ledger.cut if c not in keep
        )
        if self._on_settled is not None:
            self._on_settled(ledger.key, [c for c in ledger.cut if c not in keep], why)
        for observe in self.settled_observers:
            observe(ledger.key, [c for c in ledger.cut if c not in keep], why)
        ledger.cut = keep
        self.settled += gone
        logger.info("%s: %d cut request(s) settled (%s)", ledger.key, gone, why)
        if not keep:
            self._poll(ledger.key, None)


# --- the evidence: what a collector event, or a host's report, settles --------------------------


def settle_remote(
    settlement: Settlement,
    ledger: InstanceLedger,
    *,
    idle_after: float | None,
    restarted_before: float | None,
    quiet_after: float | None = None,
) -> None:
    """A host's report on a remote instance: its ingress and engine were seen idle in a
    sample taken no earlier than ``idle_after`` (and ``quiet_after``: that sample came
    `QUIET_GRACE_S` after the ingress's last forward ended), or its engine restarted or stopped
    no earlier than ``restarted_before`` (all on the settlement's clock)."""
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
    if quiet_after is not None:
        settlement.settle(
            ledger,
            lambda c: c.rule is SettleRule.WHEN_QUIET_ON_HOST and c.cut_at < quiet_after,
            f"engine idle and ingress quiet for {QUIET_GRACE_S:g} s on its host",
            sample_requested_at=quiet_after,
        )
