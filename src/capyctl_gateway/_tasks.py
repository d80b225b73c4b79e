"""The owner of a room's background tasks: a task group its owner opens, and closes in order.

Every task the engine wing runs (an activation, a closing, an engine's exit watch, the idle
watch) is spawned through a `Supervisor` that the fleet opens and closes. Unlike
``asyncio.TaskGroup``, one task's failure does not cancel its siblings: a request's activation
failing must not stop another deployment's closing. What it guarantees instead:

- A task that ends in a documented refusal (a `GatewayError`) has been answered by its own
  code; its exception is retrieved here, never logged twice.
- Any other exception is a defect in the gateway: `fault` logs it once with its traceback,
  counts it (``capyctl_task_faults_total``) and gives back an `InternalError` for the code that
  must answer its waiters. A task that raises one unhandled is faulted by its done callback.
- A long-lived loop (`keep`) is never silently gone: a fault in one of its turns is logged and
  counted, and the loop goes on after a delay that doubles up to `KEEP_BACKOFF_MAX_S` (so a
  fault on every turn writes a bounded number of log lines). It ends only when a turn says its
  work is done, or when the supervisor closes.
- `aclose` cancels every task and waits for each, including tasks spawned while it closes.

Imports only the error tree.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from ._errors import GatewayError, InternalError

__all__ = ["FAULT_KINDS", "KEEP_BACKOFF_FIRST_S", "KEEP_BACKOFF_MAX_S", "Supervisor"]

logger = logging.getLogger("capyctl_gateway")
T = TypeVar("T")

FAULT_KINDS = (
    "activation",
    "closing",
    "exit_watch",
    "idle_watch",
    "pod_delete",
    "pod_watch",
    "task",
)
"""The ``task`` label values of ``capyctl_task_faults_total``: what was running when a defect
showed (a fixed set, so the metric's labels never come from an exception's text)."""
KEEP_BACKOFF_MAX_S = 60.0
"""The longest a kept loop waits after a fault before its next turn."""
KEEP_BACKOFF_FIRST_S = 0.5
"""The least a kept loop waits after a fault (however short its period)."""


class Supervisor:
    """Background tasks of one owner (see the module's docstring)."""

    def __init__(self, name: str, *, faults: Counter[str] | None = None) -> None:
        """``faults``: where its defects are counted (shared by supervisors whose defects one
        metric counts); a new counter by default."""
        self.name = name
        self.faults: Counter[str] = Counter() if faults is None else faults
        """kind (one of `FAULT_KINDS`) -> defects seen."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False

    def __len__(self) -> int:
        return len(self._tasks)

    def fault(self, kind: str, what: str, exc: BaseException) -> InternalError:
        """Log the defect ``exc`` (``what`` was under way) once with its traceback and count it
        under ``kind``; the error to answer its waiters with (500 ``internal_error``, whose
        message names no address and no exception text)."""
        self.faults[kind if kind in FAULT_KINDS else "task"] += 1
        logger.error("%s: internal error while %s", self.name, what, exc_info=exc)
        return InternalError(
            f"the gateway failed while {what} (an internal error, logged with its traceback)"
        )

    def spawn(
        self, coro: Coroutine[Any, Any, T], *, kind: str = "task", what: str = "a task"
    ) -> asyncio.Task[T]:
        """Run ``coro`` as a task this supervisor owns. A defect it raises unhandled (anything
        but a `GatewayError` or its cancellation) is logged and counted when it ends, as
        `fault` does; its awaiters still see it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: self._ended(t, kind, what))
        if self._closing:  # spawned by a task's last words while closing: it ends at once
            task.cancel()
        return task

    def keep(
        self,
        step: Callable[[], Awaitable[bool | None]],
        *,
        every: float,
        kind: str,
        what: str,
        first: float | None = None,
    ) -> asyncio.Task[None]:
        """Run ``step`` every ``every`` seconds (the first turn after ``first``, by default
        ``every``) for as long as the supervisor is open, or until a turn returns True (its
        work is done); a turn that faults is logged and counted, and the next waits longer
        (from `KEEP_BACKOFF_FIRST_S`, doubling up to `KEEP_BACKOFF_MAX_S`) until one
        succeeds."""
        start = every if first is None else first
        return self.spawn(self._keep(step, every, start, kind, what), kind=kind, what=what)

    async def _keep(
        self,
        step: Callable[[], Awaitable[bool | None]],
        every: float,
        wait: float,
        kind: str,
        what: str,
    ) -> None:
        while True:
            await asyncio.sleep(wait)
            try:
                done = await step()
            except Exception as exc:  # a defect: said, counted, and the loop goes on
                self.fault(kind, what, exc)
                wait = min(max(wait, every, KEEP_BACKOFF_FIRST_S) * 2.0, KEEP_BACKOFF_MAX_S)
                logger.warning("%s: %s goes on in %.0f s", self.name, what, wait)
            else:
                if done:
                    return
                wait = every

    def _ended(self, task: asyncio.Task[Any], kind: str, what: str) -> None:
        if task.cancelled():
            return
        exc = task.exception()  # retrieved: its waiters may all have left
        if exc is not None and not isinstance(exc, GatewayError):
            self.fault(kind, what, exc)

    async def aclose(self) -> None:
        """Cancel every task and wait for each to end (tasks spawned meanwhile too)."""
        self._closing = True
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
