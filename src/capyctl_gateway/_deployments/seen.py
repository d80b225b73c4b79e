"""What the collector says of an engine on this machine: its load as one `LoadSample`, what
``status`` shows of it, and how long it has answered none of its polls.

Never imports the HTTP surface, the relay, the management API or the gateway's state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from canopyx_provider import Collector, EngineAdapter, TargetState

from .runner import CacheCounts, Described, LoadSample, Shown

__all__ = ["Seen", "SeenBy"]


class Seen:
    """One engine as the collector polls it (once it is watched)."""

    def __init__(self, collector: Collector, key: str, clock: Callable[[], float]) -> None:
        self._collector, self._key, self._clock = collector, key, clock
        self.watched = False
        self._heard_at = 0.0
        self._judged = False
        """The collector has finished its first look since the engine was watched."""

    def watch(self, adapter: EngineAdapter, model_id: str) -> None:
        """Have the collector poll the engine, which has just answered."""
        self._collector.add(self._key, adapter, model_id=model_id)
        self.watched, self._heard_at, self._judged = True, self._clock(), False

    def unwatch(self) -> None:
        if self.watched:
            self._collector.remove(self._key)
            self.watched = False

    def sample(self) -> LoadSample | None:
        """The engine's load from its latest snapshot (KV-cache usage, else slot usage)."""
        snap = self._collector.snapshot(self._key) if self.watched else None
        if snap is None:
            return None
        m = snap.metrics
        usage = m.kv_cache_usage_ratio
        usage = usage if usage is not None else m.slot_usage_ratio
        age = max(self._clock() - snap.requested_at, 0.0)
        return LoadSample(m.running_requests, m.waiting_requests, usage, age, "collector")

    def prefix_cache(self) -> CacheCounts | None:
        """The engine's own prefix-cache counts in its latest snapshot, however old."""
        status = self._collector.status(self._key) if self.watched else None
        snap = status.latest if status is not None else None
        if snap is None:
            return None
        queried = snap.metrics.prefix_cache_queried_tokens_total
        hits = snap.metrics.prefix_cache_hit_tokens_total
        if queried is None or hits is None:
            return None
        return CacheCounts(int(queried), int(hits))

    def stale(self) -> bool:
        """No fresh sample, once the collector's first look since the engine was watched (its
        start) is over: its samples aged, or its polls or checks failed. Not while that first
        look runs (an engine just started is not suspect)."""
        if not self.watched:
            return False
        if not self._judged:
            if self._collector.status(self._key).state is TargetState.CONNECTING:
                return False
            self._judged = True
        return self._collector.snapshot(self._key) is None

    def row(self) -> dict[str, Any]:
        """What ``status`` shows of the engine: the collector's state, its latest load and the
        snapshot's age, its prefix cache's own counts (prompt tokens looked up and found, since
        it started; where it publishes them) and its last error."""
        if not self.watched:
            return {}
        status = self._collector.status(self._key)
        row: dict[str, Any] = {"state": status.state.value}
        snap = status.latest
        if snap is not None:
            row["running"] = snap.metrics.running_requests
            row["waiting"] = snap.metrics.waiting_requests
            row["snapshot_age_s"] = round(snap.age_s(self._clock()), 3)
            counts = self.prefix_cache()
            if counts is not None:
                row["prefix_cache"] = counts.row()
        if status.error:
            row["error"] = status.error
        return row

    def described(self, lines: tuple[Shown, ...] = (), **fields: Any) -> Described:
        """The engine as the collector sees it (`row`), with a kind's own ``fields`` and
        ``lines``."""
        row = self.row()
        return Described(watched=row.pop("state", None), fields={**row, **fields}, lines=lines)

    def silent_s(self) -> float | None:
        """How long the engine has answered none of its polls; None while it answers. An
        engine whose load was never read since it was watched (it failed a startup check: one
        metric missing) is judged by what it does answer, its health: it serves, and it is
        never stopped for the check it failed."""
        if not self.watched:
            return None
        status = self._collector.status(self._key)
        if status.state is TargetState.READY and status.latest is not None:
            self._heard_at = max(self._heard_at, status.latest.requested_at)
            return None
        if status.collected_at is None and status.answered_at is not None:
            self._heard_at = max(self._heard_at, status.answered_at)
        return self._clock() - self._heard_at


class SeenBy:
    """For a runner whose engine the collector polls at its address (``self.seen``): the
    seam's reads of its load, freshness, prefix cache and silence, as the collector says."""

    seen: Seen

    def sample(self) -> LoadSample | None:
        return self.seen.sample()

    def stale(self) -> bool:
        return self.seen.stale()

    def prefix_cache(self) -> CacheCounts | None:
        return self.seen.prefix_cache()

    def silent_s(self) -> float | None:
        return self.seen.silent_s()
