"""A virtual clock for asyncio, as trio's ``MockClock(autojump_threshold=0)`` and anyio's test
clocks are: an event loop whose time jumps to its next timer whenever nothing else can run.

`VirtualLoop` reads the gateway's one clock (``capyctl_gateway._clock``), so the loop's timers
(``asyncio.sleep``, ``asyncio.timeout``, anyio's ``fail_after``, aiohttp's and httpx's
timeouts), the lifecycle's idle clock, backoffs, drain and startup timeouts, the request
deadlines and the collector's freshness all read the same time, and all of it moves together.
When the loop would wait for its next timer, it first asks its sockets whether anything is
ready now (no wait); if nothing is, and no thread is doing work for it (`run_in_executor`:
name lookups, file I/O), the clock jumps to that timer instead of waiting. A test of minutes of
schedule runs in the seconds its own work takes.

What it cannot drive: another process (an engine process, a worker), which runs on real time,
and a thread started without the loop's executor. Use it where every peer runs in this loop:
the fake runner's engines, the fake engine, in-process clients.

Use: ``anyio_backend`` returning ``("asyncio", {"loop_factory": VirtualLoop})``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors
from collections.abc import Callable
from typing import Any, TypeVar

from capyctl_gateway import _clock

__all__ = ["VirtualLoop"]

T = TypeVar("T")
BUSY_WAIT_S = 0.05
"""How long the loop waits for real while a thread works for it, before it looks again."""


class _JumpingSelector:
    """The loop's selector, with a wait for the next timer turned into a jump."""

    def __init__(self, loop: VirtualLoop, inner: selectors.BaseSelector) -> None:
        self._loop, self._inner = loop, inner

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:
            return self._inner.select(timeout)
        ready = self._inner.select(0)
        if ready:
            return ready
        if self._loop.in_threads:  # a thread will wake the loop: wait for it for real
            return self._inner.select(BUSY_WAIT_S if timeout is None else min(timeout, BUSY_WAIT_S))
        if timeout is None:  # no timer at all: only I/O can come, and it comes in real time
            return self._inner.select(None)
        self._loop.jumped += timeout
        _clock.advance(timeout)
        return []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class VirtualLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on the gateway's clock, jumping it forward whenever it idles."""

    opened: bool = False
    """Whether a virtual loop is open (there is one clock: one at a time)."""

    def __new__(cls) -> VirtualLoop:
        if VirtualLoop.opened or _clock.offset():
            raise RuntimeError("another virtual clock runs (or one was not closed)")
        return super().__new__(cls)

    def __init__(self) -> None:
        super().__init__()
        VirtualLoop.opened = True
        inner: selectors.BaseSelector = getattr(self, "_selector")  # noqa: B009 (asyncio's own)
        setattr(self, "_selector", _JumpingSelector(self, inner))  # noqa: B010
        self.in_threads = 0
        """Calls running in the executor for this loop now."""
        self.jumped = 0.0
        """Seconds the clock has jumped."""

    def time(self) -> float:
        return _clock.stamp()

    def run_in_executor(  # type: ignore[override]
        self, executor: concurrent.futures.Executor | None, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        future = super().run_in_executor(executor, func, *args)
        self.in_threads += 1
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _: asyncio.Future[Any]) -> None:
        self.in_threads -= 1

    def close(self) -> None:
        super().close()
        _clock.reset()
        VirtualLoop.opened = False
