"""One engine's collection, as the collector runs it: the startup checks, then the polls.

`Cycles` does the I/O for every engine of a `Collector` and records what it found on that
engine's `Target`: its state, checks, discovery and latest snapshot, or its failure (which
drops the snapshot and sends the engine back through the checks). Each request is bounded by
the options' timeout; a startup step is retried, bounded in tries and in time, while the engine
is unreachable or slow.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

import anyio
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, stop_after_delay
from tenacity.wait import wait_exponential_jitter

from ._errors import (
    CanopyxError,
    EngineUnreachableError,
    ModelNotListedError,
    ScrapeTimeoutError,
    error_code,
)
from ._events import ChecksCompleted, EngineRestarted, Event, ScrapeFailed, ScrapeSucceeded
from ._options import ProviderOptions
from ._scrape import Fetcher, RawResponse
from ._snapshot import (
    CheckName,
    CheckReport,
    CheckResult,
    EngineMetrics,
    EngineSnapshot,
    SupportLevel,
)
from .adapters import Discovery, EngineAdapter, Poll

__all__ = ["Cycles", "Target", "TargetState"]

T = TypeVar("T")


class TargetState(StrEnum):
    """Where one engine stands in the collector."""

    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"


@dataclass(eq=False)
class Target:
    """One engine the collector collects from, and what it knows of it."""

    key: str
    adapter: EngineAdapter
    model_id: str
    default_interval_s: float
    interval_s: float
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    wake: anyio.Event = field(default_factory=anyio.Event)
    state: TargetState = TargetState.CONNECTING
    discovery: Discovery | None = None
    snapshot: EngineSnapshot | None = None
    checks: tuple[CheckResult, ...] = ()
    error: str | None = None
    process_start: float | None = None
    answered_at: float | None = None
    """When the engine last answered its health check (asked at)."""
    collected_at: float | None = None
    """When a whole collection last succeeded (asked at); kept across failures."""
    scope: anyio.CancelScope | None = None


_ORDER: tuple[CheckName, ...] = ("health", "models", "discovery", "metrics")


class Cycles:
    """The startup checks and polls of a collector's engines (see the module's text)."""

    def __init__(
        self,
        options: ProviderOptions,
        clock: Callable[[], float],
        emit: Callable[[Event], None],
        fetcher: Callable[[], Fetcher],
    ) -> None:
        self.options = options
        self._clock = clock
        self._emit = emit
        self._fetcher = fetcher

    async def _bounded(self, t: Target, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            with anyio.fail_after(self.options.request_timeout_s):
                return await fn()
        except TimeoutError as exc:
            raise ScrapeTimeoutError(
                f"{t.adapter.base_url}: no answer within {self.options.request_timeout_ms} ms",
                url=t.adapter.base_url,
            ) from exc

    async def _attempt(self, t: Target, fn: Callable[[], Awaitable[T]]) -> T:
        """A startup step, retried while the engine is unreachable or slow (bounded)."""
        budget = self.options.request_timeout_s * self.options.connect_attempts
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.options.connect_attempts) | stop_after_delay(budget),
            wait=wait_exponential_jitter(multiplier=0.1, max=1.0, jitter=0.1),
            retry=retry_if_exception_type((EngineUnreachableError, ScrapeTimeoutError)),
            sleep=anyio.sleep,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._bounded(t, fn)
        raise AssertionError("unreachable: tenacity reraises")  # pragma: no cover

    async def connect(self, t: Target) -> CheckReport:
        """Run ``t``'s startup checks; on success, its first snapshot is taken."""
        fetch, adapter, model = self._fetcher(), t.adapter, t.model_id
        t.state = TargetState.CONNECTING
        results: list[CheckResult] = []
        requested_at = self._clock()
        discovery: Discovery | None = None
        poll: Poll | None = None
        failure: tuple[CheckName, CanopyxError] | None = None
        try:
            health = await self._attempt(t, lambda: adapter.check_health(fetch))
            t.answered_at = requested_at
            results.append(CheckResult(name="health", ok=True))
            ids = await self._attempt(t, lambda: adapter.list_models(fetch))
            if model not in ids:
                raise ModelNotListedError(model, listed=ids)
            results.append(CheckResult(name="models", ok=True))
            discovery = await self._attempt(t, lambda: adapter.discover(fetch, model))
            results.append(CheckResult(name="discovery", ok=True))
            if adapter.support is not SupportLevel.LIMITED:
                d = discovery
                poll = await self._bounded(t, lambda: adapter.collect(fetch, model, d, health))
                results.append(CheckResult(name="metrics", ok=True))
        except CanopyxError as exc:
            failure = (_ORDER[len(results)], exc)
        if failure is not None:
            name, error = failure
            results.append(
                CheckResult(name=name, ok=False, reason=error.message, code=error_code(error))
            )
            wanted = _ORDER if adapter.support is not SupportLevel.LIMITED else _ORDER[:3]
            results.extend(
                CheckResult(
                    name=n, ok=False, reason=f"not run: the {name} check failed", code="not_run"
                )
                for n in wanted[len(results) :]
            )
            t.checks = tuple(results)
            self._fail(t, name, error)
            report = CheckReport(checks=t.checks)
        else:
            assert discovery is not None
            t.discovery = discovery
            t.checks = tuple(results)
            self._accept(t, poll or Poll(EngineMetrics(has_engine_load=False)), requested_at)
            report = CheckReport(
                checks=t.checks,
                metrics=t.snapshot.metrics if t.snapshot else None,
                capacity=discovery.capacity,
                engine_version=discovery.engine_version,
            )
        self._emit(ChecksCompleted(t.key, report))
        return report

    async def poll(self, t: Target) -> None:
        """Poll ``t`` once for health and load."""
        fetch, adapter, discovery = self._fetcher(), t.adapter, t.discovery
        assert discovery is not None
        requested_at = self._clock()
        stage: CheckName = "health"

        async def cycle() -> Poll:
            nonlocal stage
            health: RawResponse = await adapter.check_health(fetch)
            t.answered_at = requested_at
            stage = "metrics"
            return await adapter.collect(fetch, t.model_id, discovery, health)

        try:
            poll = await self._bounded(t, cycle)
        except CanopyxError as exc:
            t.checks = tuple(
                CheckResult(name=stage, ok=False, reason=exc.message, code=error_code(exc))
                if c.name == stage
                else c
                for c in t.checks
            )
            self._fail(t, stage, exc)
            return
        self._accept(t, poll, requested_at)

    def _accept(self, t: Target, poll: Poll, requested_at: float) -> None:
        assert t.discovery is not None
        start = poll.process_start if poll.process_start is not None else t.discovery.process_start
        snap = EngineSnapshot(
            engine=t.adapter.kind,
            model_id=t.model_id,
            metrics=poll.metrics,
            capacity=t.discovery.capacity,
            engine_version=t.discovery.engine_version,
            requested_at=requested_at,
            collected_at=self._clock(),
            process_start=start,
        )
        previous, t.process_start = t.process_start, start
        t.snapshot, t.state, t.error = snap, TargetState.READY, None
        t.collected_at = requested_at
        self._emit(ScrapeSucceeded(t.key, snap))
        if previous is not None and start is not None and previous != start:
            # A new process may have other capacity: go through discovery again at once.
            t.discovery = None
            t.wake.set()
            self._emit(EngineRestarted(t.key, previous, start))

    def _fail(self, t: Target, check: CheckName, error: CanopyxError) -> None:
        t.snapshot, t.discovery = None, None
        t.state, t.error = TargetState.FAILED, f"{check}: {error.message}"
        self._emit(ScrapeFailed(t.key, check, error, self._clock()))
