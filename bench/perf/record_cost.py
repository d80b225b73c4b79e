"""What recording one request in the gateway's own metrics costs on the hot path: the outcome,
the counters and six timings (``_tally.py``), measured in-process with timeit.

Run from the repository root: ``.venv/bin/python -m bench.perf.record_cost``.
"""

from __future__ import annotations

import asyncio
import timeit

from yarl import URL

from capyctl_gateway._relay.exchange import Exchange
from capyctl_gateway._tally import Tally, record
from capyctl_gateway._telemetry import Ending, Telemetry

__all__ = ["main"]


async def _measure(n: int) -> float:
    loop = asyncio.get_running_loop()
    t = Telemetry()
    ex = Exchange(
        None,  # type: ignore[arg-type]  # recording never touches the session
        URL("http://127.0.0.1:1"),
        {},
        where="deployment bench, instance 0",
        deadline=0.0,
        idle_timeout=1.0,
        drains=set(),
    )
    now = loop.time()
    ex.outcome.completed = True
    ex.outcome.ending = Ending.COMPLETED
    ex.outcome.head_at, ex.outcome.first_content_at, ex.outcome.last_at = now, now, now

    def one() -> None:
        tally = Tally("chat", loop.time())
        tally.deployment, tally.slot = "bench", loop.time()
        tally.ex, tally.instance = ex, 0
        tally.ended()
        record(t, tally)

    return min(timeit.repeat(one, number=n, repeat=5)) / n


def main() -> int:
    per = asyncio.run(_measure(100_000))
    print(f"recording one request: {per * 1e6:.2f} us (best of 5 x 100,000)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
