"""Requests of one deployment waiting for an instance to take them (a `Route`'s)."""

from __future__ import annotations

import asyncio

__all__ = ["Waiters"]


class Waiters:
    """Requests of one deployment waiting for an instance to take them."""

    __slots__ = ("_changed", "waiting")

    def __init__(self) -> None:
        self._changed: asyncio.Event | None = None
        self.waiting = 0
        """Requests (with a running slot) waiting now: the lifecycle counts them as waiting."""

    def notify(self) -> None:
        """An instance opened or closed: requests waiting for one look again."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait(self, within: float) -> bool:
        """Wait up to ``within`` seconds for an instance to become available; whether one did."""
        if self._changed is None:
            self._changed = asyncio.Event()
        self.waiting += 1
        try:
            await asyncio.wait_for(self._changed.wait(), max(within, 0))
        except TimeoutError:
            return False
        finally:
            self.waiting -= 1
        return True
