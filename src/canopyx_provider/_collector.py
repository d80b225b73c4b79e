"""The polling collector: one loop per engine, outside every quote callback.

Each engine is connected first (health, models, discovery and, for engines that publish load,
metrics validation), then polled for health and load every ``poll_interval_ms``. A failed poll
throws the snapshot away at once and sends the engine back through the startup checks; a snapshot
older than ``max_metrics_age_ms`` is never handed out. Readers (`Collector.snapshot`) do no I/O.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import TracebackType
from typing import Self, TypeVar

import anyio
import httpx
from anyio.abc import TaskGroup
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, stop_after_delay
from tenacity.wait import wait_exponential_jitter

from ._errors import (
    CanopyxError,
    ConfigError,
    EngineUnreachableError,
    ModelNotListedError,
    ScrapeTimeoutError,
    error_code,
)
from ._events import (
    ChecksCompleted,
    EngineRestarted,
    Event,
    EventHook,
    ScrapeFailed,
    ScrapeSucceeded,
)
from ._options import ProviderOptions
from ._scrape import Fetcher, HttpxFetcher, RawResponse
from ._snapshot import (
    Capacity,
    CheckName,
    CheckReport,
    CheckResult,
    EngineMetrics,
    EngineSnapshot,
    SupportLevel,
)
from .adapters import Discovery, EngineAdapter, Poll

__all__ = ["Collector", "EngineStatus", "TargetState"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class TargetState(StrEnum):
    """Where one engine stands in the collector."""

    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"


class _Lifecycle(StrEnum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """One engine as the collector sees it now: the provider's overview row."""

    key: str
    adapter: EngineAdapter
    model_id: str
    state: TargetState
    checks: tuple[CheckResult, ...]
    """The latest startup checks; a later poll failure replaces the failed one's reason."""
    error: str | None
    latest: EngineSnapshot | None
    """The last snapshot, fresh or not (None after a failure)."""
    fresh: bool
    poll_interval_s: float


@dataclass(eq=False)
class _Target:
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
    scope: anyio.CancelScope | None = None


_ORDER: tuple[CheckName, ...] = ("health", "models", "discovery", "metrics")


class Collector:
    """Polls engines on its own schedule and keeps their latest valid snapshot.

    Use it as an async context manager; it owns a task group with one loop per engine::

        async with Collector(options=ProviderOptions()) as collector:
            collector.add("main", vllm("http://127.0.0.1:8000"), model_id="Qwen3-4B")
            ...
            snap = collector.snapshot("main")   # None when failed or stale; no I/O

    Args:
        options: poll interval, request timeout, maximum snapshot age.
        client: an ``httpx.AsyncClient`` to use; its owner closes it. Without one the
            collector makes and closes its own.
        fetcher: a `Fetcher` to use instead of HTTP (tests, other transports).
        clock: wall-clock time in seconds (injected in tests).
        hooks: receivers of collector events.
    """

    def __init__(
        self,
        *,
        options: ProviderOptions | None = None,
        client: httpx.AsyncClient | None = None,
        fetcher: Fetcher | None = None,
        clock: Callable[[], float] = time.time,
        hooks: Sequence[EventHook] = (),
    ) -> None:
        self.options = options or ProviderOptions()
        self._client = client
        self._owns_client = False
        self._fetch = fetcher
        self._clock = clock
        self._hooks = tuple(hooks)
        self._targets: dict[str, _Target] = {}
        self._tg: TaskGroup | None = None
        self._life = _Lifecycle.NEW

    # -- lifecycle ------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        if self._life is not _Lifecycle.NEW:
            raise RuntimeError("a Collector can be entered once")
        if self._fetch is None:
            if self._client is None:
                timeout = self.options.request_timeout_s
                # Idle connections expire before the engines' own 5 s idle limit (llama-server,
                # uvicorn), so a poll never goes out on a connection the engine is closing.
                limits = httpx.Limits(keepalive_expiry=4.0)
                self._client = httpx.AsyncClient(
                    timeout=timeout, follow_redirects=False, limits=limits
                )
                self._owns_client = True
            self._fetch = HttpxFetcher(self._client, clock=self._clock)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._life = _Lifecycle.RUNNING
        for t in self._targets.values():
            self._start(t)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        tg, self._tg = self._tg, None
        self._life = _Lifecycle.CLOSED
        try:
            if tg is not None:
                tg.cancel_scope.cancel("collector closed")
                return await tg.__aexit__(exc_type, exc, tb)
            return None
        finally:
            if self._owns_client and self._client is not None:
                with anyio.CancelScope(shield=True):
                    await self._client.aclose()

    # -- engines --------------------------------------------------------------------------
    def add(self, key: str, adapter: EngineAdapter, *, model_id: str, poll: bool = True) -> None:
        """Collect from ``adapter`` under ``key``. With ``poll=False`` nothing runs until
        `refresh` or `check` is awaited."""
        if key in self._targets:
            raise ConfigError(f"an engine named {key!r} is already collected")
        if not model_id:
            raise ConfigError("model_id must be the engine's model ID, not empty")
        interval = self.options.poll_interval_s
        t = _Target(key, adapter, model_id, default_interval_s=interval, interval_s=interval)
        self._targets[key] = t
        if poll:
            self.start_polling(key)

    def start_polling(self, key: str) -> None:
        """Start the polling loop of an engine added with ``poll=False``."""
        t = self._targets[key]
        if t.scope is None:
            t.scope = anyio.CancelScope()
            if self._life is _Lifecycle.RUNNING:
                self._start(t)

    def remove(self, key: str) -> None:
        t = self._targets.pop(key)
        if t.scope is not None:
            t.scope.cancel(f"engine {key} removed")

    def keys(self) -> tuple[str, ...]:
        return tuple(self._targets)

    def set_poll_interval(self, key: str, interval_ms: int | None) -> None:
        """Poll ``key`` every ``interval_ms`` (None: the options' interval) from now on."""
        t = self._targets[key]
        t.interval_s = interval_ms / 1000 if interval_ms is not None else t.default_interval_s
        t.wake.set()

    # -- readers (no I/O) -----------------------------------------------------------------
    def snapshot(self, key: str) -> EngineSnapshot | None:
        """The latest snapshot when it is valid and fresh, else None."""
        snap = self._targets[key].snapshot
        if snap is None or not snap.is_fresh(self._clock(), self.options.max_metrics_age_s):
            return None
        return snap

    def capacity(self, key: str) -> Capacity | None:
        discovery = self._targets[key].discovery
        return discovery.capacity if discovery is not None else None

    def status(self, key: str) -> EngineStatus:
        t = self._targets[key]
        return EngineStatus(
            key=key,
            adapter=t.adapter,
            model_id=t.model_id,
            state=t.state,
            checks=t.checks,
            error=t.error,
            latest=t.snapshot,
            fresh=self.snapshot(key) is not None,
            poll_interval_s=t.interval_s,
        )

    def overview(self) -> dict[str, EngineStatus]:
        return {key: self.status(key) for key in self._targets}

    # -- I/O ------------------------------------------------------------------------------
    async def refresh(self, key: str) -> EngineSnapshot | None:
        """Run one collection cycle for ``key`` now (connecting first if needed)."""
        t = self._targets[key]
        async with t.lock:
            if t.discovery is None:
                await self._connect(t)
            else:
                await self._poll(t)
        return self.snapshot(key)

    async def check(self, key: str) -> CheckReport:
        """Run the startup checks for ``key`` now and return their report."""
        t = self._targets[key]
        async with t.lock:
            return await self._connect(t)

    def __repr__(self) -> str:
        states = ", ".join(f"{k}={t.state.value}" for k, t in self._targets.items())
        return f"<Collector {self._life.value} [{states}]>"

    # -- internals ------------------------------------------------------------------------
    def _start(self, t: _Target) -> None:
        if t.scope is not None and self._tg is not None:
            self._tg.start_soon(self._loop, t, name=f"canopyx collector {t.key}")

    async def _loop(self, t: _Target) -> None:
        assert t.scope is not None
        with t.scope:
            while True:
                async with t.lock:
                    if t.discovery is None:
                        await self._connect(t)
                    else:
                        await self._poll(t)
                with anyio.move_on_after(t.interval_s):
                    await t.wake.wait()
                t.wake = anyio.Event()

    def _emit(self, event: Event) -> None:
        for hook in self._hooks:
            hook(event)

    @property
    def _fetcher(self) -> Fetcher:
        if self._fetch is None:
            raise RuntimeError("use the Collector as an async context manager first")
        return self._fetch

    async def _bounded(self, t: _Target, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            with anyio.fail_after(self.options.request_timeout_s):
                return await fn()
        except TimeoutError as exc:
            raise ScrapeTimeoutError(
                f"{t.adapter.base_url}: no answer within {self.options.request_timeout_ms} ms",
                url=t.adapter.base_url,
            ) from exc

    async def _attempt(self, t: _Target, fn: Callable[[], Awaitable[T]]) -> T:
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

    async def _connect(self, t: _Target) -> CheckReport:
        fetch, adapter, model = self._fetcher, t.adapter, t.model_id
        t.state = TargetState.CONNECTING
        results: list[CheckResult] = []
        requested_at = self._clock()
        discovery: Discovery | None = None
        poll: Poll | None = None
        failure: tuple[CheckName, CanopyxError] | None = None
        try:
            health = await self._attempt(t, lambda: adapter.check_health(fetch))
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

    async def _poll(self, t: _Target) -> None:
        fetch, adapter, discovery = self._fetcher, t.adapter, t.discovery
        assert discovery is not None
        requested_at = self._clock()
        stage: CheckName = "health"

        async def cycle() -> Poll:
            nonlocal stage
            health: RawResponse = await adapter.check_health(fetch)
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

    def _accept(self, t: _Target, poll: Poll, requested_at: float) -> None:
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
        self._emit(ScrapeSucceeded(t.key, snap))
        if previous is not None and start is not None and previous != start:
            # A new process may have other capacity: go through discovery again at once.
            t.discovery = None
            t.wake.set()
            self._emit(EngineRestarted(t.key, previous, start))

    def _fail(self, t: _Target, check: CheckName, error: CanopyxError) -> None:
        t.snapshot, t.discovery = None, None
        t.state, t.error = TargetState.FAILED, f"{check}: {error.message}"
        self._emit(ScrapeFailed(t.key, check, error, self._clock()))
