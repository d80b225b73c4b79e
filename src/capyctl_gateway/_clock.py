"""The gateway's one clock.

Everything that times the gateway's own work reads it: deadlines and timers run on the event
loop's time (``loop.time()``); `stamp` reads the same clock at its full resolution (under uvloop
``loop.time()`` is kept in whole milliseconds, so figures taken from it would come out as 7.0 and
4.0 ms): a request's milestones (its arrival, the engine's head, the first and last output), the
lifecycle's idle clock, each state's start, crash backoffs, an owed delete's age. A deadline
derived from a stamp is comparable with ``loop.time()`` to within that millisecond. `wall` is the
same clock on the wall's scale (seconds since the epoch): what the collector stamps its snapshots
with and judges their freshness by, and what settlement reads.

A virtual clock moves it: `advance` jumps it forward, for an event loop whose time is `stamp`
(``tests/vclock.py``: it jumps to its next timer whenever nothing else can run, as trio's
``MockClock`` with ``autojump_threshold=0`` does), so that minutes of the lifecycle's timeouts
pass in the seconds its work takes. Unmoved, `stamp` is ``time.monotonic`` and `wall` is
``time.time``: what asyncio's and uvloop's loops read.

The hot path reads `now`, the same clock without a Python frame while nothing moves it.

Imports nothing of the gateway.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["advance", "now", "offset", "reset", "stamp", "wall"]

_monotonic, _time = time.monotonic, time.time
_by = 0.0
"""How far a virtual clock has moved this one (0 unless a test's loop moves it): a module
global, which a hot path's `stamp` reads for less than a class attribute (about 10 ns)."""


def stamp() -> float:
    """The clock now (``time.monotonic``'s scale and resolution)."""
    return _monotonic() + _by


now: Callable[[], float] = _monotonic
"""`stamp` for the hot path, read as ``_clock.now()`` at each call: ``time.monotonic`` itself
(a C call, where `stamp` is a Python frame more: about 400 instructions, at every request's
milestones and every engine read) while no virtual clock has moved the clock, `stamp` while one
has. The same value as `stamp` either way (a clock moved by 0.0 reads the same)."""


def wall() -> float:
    """The clock now on the wall's scale (``time.time``'s)."""
    return _time() + _by


def advance(seconds: float) -> None:
    """Move the clock forward by ``seconds`` (a virtual clock's jump)."""
    global _by, now
    _by += seconds
    now = stamp


def offset() -> float:
    """How far the clock has been moved."""
    return _by


def reset() -> None:
    """Put the clock back on real time (its virtual clock is closed)."""
    global _by, now
    _by = 0.0
    now = _monotonic
