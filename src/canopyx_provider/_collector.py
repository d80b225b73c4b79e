"""The polling collector: one loop per engine, outside every quote callback.

Each engine is connected first (health, models, discovery and, for engines that publish load,
metrics validation), then polled for health and load every ``poll_interval_ms``. A failed poll
throws the snapshot away at once and sends the engine back through the startup checks; a snapshot
older than ``max_metrics_age_ms`` is never handed out. Readers (`Collector.snapshot`) do no I/O.
The checks and polls themselves are `_cycle.py`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Self

import anyio
import httpx
from anyio.abc import TaskGroup

from ._cycle import Cycles, Target, TargetState
from ._errors import ConfigError
from ._events import Event, EventHook
from ._options import ProviderOptions
from ._scrape import Fetcher, HttpxFetcher
from ._snapshot import Capacity, CheckReport, CheckResult, EngineSnapshot
from .adapters import EngineAdapter

__all__ = ["Collector", "EngineStatus", "TargetState"]


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
    answered_at: float | None = None
    """When the engine last answered its health check (the clock's time it was asked), in a
    startup check or a poll; None if it never has since it was added."""
    collected_at: float | None = None
    """When a whole collection (health and load) last succeeded (the time it was asked); kept
    when a later one fails; None if none has since it was added."""


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
        self._targets: dict[str, Target] = {}
        self._tg: TaskGroup | None = None
        self._life = _Lifecycle.NEW
        self._cycles = Cycles(self.options, clock, self._emit, lambda: self._fetcher)

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
        t = Target(key, adapter, model_id, default_interval_s=interval, interval_s=interval)
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

    def subscribe(self, hook: EventHook) -> None:
        """Send every event from now on to ``hook`` too (after the hooks given before it)."""
        self._hooks = (*self._hooks, hook)

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
            answered_at=t.answered_at,
            collected_at=t.collected_at,
        )

    def overview(self) -> dict[str, EngineStatus]:
        return {key: self.status(key) for key in self._targets}

    # -- I/O ------------------------------------------------------------------------------
    async def refresh(self, key: str) -> EngineSnapshot | None:
        """Run one collection cycle for ``key`` now (connecting first if needed)."""
        t = self._targets[key]
        async with t.lock:
            if t.discovery is None:
                await self._cycles.connect(t)
            else:
                await self._cycles.poll(t)
        return self.snapshot(key)

    async def check(self, key: str) -> CheckReport:
        """Run the startup checks for ``key`` now and return their report."""
        t = self._targets[key]
        async with t.lock:
            return await self._cycles.connect(t)

    def __repr__(self) -> str:
        states = ", ".join(f"{k}={t.state.value}" for k, t in self._targets.items())
        return f"<Collector {self._life.value} [{states}]>"

    # -- internals ------------------------------------------------------------------------
    def _start(self, t: Target) -> None:
        if t.scope is not None and self._tg is not None:
            self._tg.start_soon(self._loop, t, name=f"canopyx collector {t.key}")

    async def _loop(self, t: Target) -> None:
        assert t.scope is not None
        with t.scope:
            while True:
                async with t.lock:
                    if t.discovery is None:
                        await self._cycles.connect(t)
                    else:
                        await self._cycles.poll(t)
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
