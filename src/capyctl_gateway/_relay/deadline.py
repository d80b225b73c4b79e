"""A deadline for the relay's hot path that costs almost nothing to push back.

``asyncio.timeout`` re-arms its timer on every ``reschedule``: the relay would cancel and
create a timer for every block the engine sends. `Deadline` keeps one timer armed. Moving the
deadline later only records the new time; when the timer fires early it re-arms for the
recorded time instead of cancelling. Moving it earlier re-arms at once.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from .._loop import running_loop

__all__ = ["Deadline"]


class Deadline:
    """``with Deadline(when):`` cancels the task at loop time ``when`` and turns that
    cancellation into `TimeoutError`, as ``asyncio.timeout_at`` does."""

    __slots__ = ("_armed", "_cancelling", "_done", "_handle", "_loop", "_task", "expired", "when")

    def __init__(self, when: float, *, first_check: float | None = None) -> None:
        """``first_check``: arm the timer for this earlier time; when it fires the deadline
        is still ``when``. For a caller that expects to move the deadline to about that time
        (the relay: to the idle timeout once output starts), this saves a re-arm."""
        self.when = when
        self.expired = False
        self._done = False
        self._armed = when if first_check is None else min(when, first_check)
        self._handle: asyncio.TimerHandle | None = None

    def __enter__(self) -> Deadline:
        self._loop = loop = running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("Deadline needs a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._arm(self._armed)
        return self

    def move(self, when: float) -> None:
        """Set the deadline to ``when``; later costs an attribute write, earlier a re-arm."""
        self.when = when
        if when < self._armed and not self.expired and not self._done:
            self._arm(when)

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed = when
        self._handle = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        if self._loop.time() < self.when:
            self._arm(self.when)  # moved later since it was armed
            return
        self.expired = True
        self._task.cancel()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self.expired:  # our cancel is taken back whatever the block raised, as asyncio does
            left = self._task.uncancel()
            if exc_type is asyncio.CancelledError and left <= self._cancelling:
                raise TimeoutError from exc
