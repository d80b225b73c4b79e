"""What each memory pool held over the last minutes: a change log of every deployment's share,
for the console's budget view and ``list --json``'s ``pools[].history``.

A record is written whenever a pool's shares change (a start or wake reserves, a transition
sets what an instance holds), none when nothing changed. Bounded twice: records older than
`SPAN_S` go, but the last one before the window is kept (what the pool held when the window
began), and a pool keeps at most `MAX_RECORDS`, the oldest going first."""

from __future__ import annotations

from collections import deque
from typing import Any

from .._clock import stamp

__all__ = ["MAX_RECORDS", "SPAN_S", "PoolHistory"]

SPAN_S = 600.0
"""How far back the history reaches (10 minutes)."""
MAX_RECORDS = 512
"""The most changes a pool keeps within the span: a pool switching faster than one change a
second for ten minutes keeps its last 512."""


class PoolHistory:
    """The changes of each pool's shares (deployment -> bytes held or promised), timed by
    ``_clock.stamp``."""

    __slots__ = ("_pools",)

    def __init__(self) -> None:
        self._pools: dict[str, deque[tuple[float, dict[str, int]]]] = {}

    def record(self, shares: dict[str, dict[str, int]]) -> None:
        """Note each pool's shares now, where they differ from its last record."""
        now = stamp()
        for pool, held in shares.items():
            log = self._pools.get(pool)
            if log is None:
                log = self._pools[pool] = deque(maxlen=MAX_RECORDS)
            if not log or log[-1][1] != held:
                log.append((now, dict(held)))
            _trim(log, now)

    def rows(self, pool: str) -> list[dict[str, Any]]:
        """The pool's records, oldest first: ``ago_s`` (seconds before now) and ``held``
        (each deployment's bytes from then until the next record). Trimmed to the span here
        too: a pool that has not changed for longer keeps only its last record."""
        now = stamp()
        log = self._pools.get(pool)
        if log is None:
            return []
        _trim(log, now)
        return [{"ago_s": round(now - at, 1), "held": held} for at, held in log]


def _trim(log: deque[tuple[float, dict[str, int]]], now: float) -> None:
    while len(log) > 1 and log[1][0] < now - SPAN_S:
        log.popleft()  # the one before the window stays: what it held as it began
