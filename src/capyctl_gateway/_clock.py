"""The clock a request's figures are read on.

Deadlines and timers run on ``loop.time()``. Under uvloop that is CLOCK_MONOTONIC read once per
loop turn and kept in whole milliseconds, so figures taken from it come out as 7.0 and 4.0 ms.
`stamp` reads the same clock (``time.monotonic``, which is what asyncio's own loop reads) at its
full resolution: every milestone of a request (its arrival, the engine's head, the first and last
output) is stamped with it, and a deadline derived from one is comparable with ``loop.time()`` to
within that millisecond.

Imports nothing of the gateway.
"""

from __future__ import annotations

import time

__all__ = ["stamp"]

stamp = time.monotonic
