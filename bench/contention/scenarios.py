"""The three scenarios of issue 44's benchmark, each a load on deployments sharing one memory
budget (every deployment ``memory.ready`` 1 GiB, the budget ``fits`` GiB):

- ``i``: two closed-loop agents, each on its own model (``a``, ``b``), a budget for one. Each
  agent sends its next request once the last is answered and its tools ran (``pause_s``).
- ``ii``: three models, a budget for two, open-loop arrivals at ``rate`` a second (exponential
  gaps, seeded), 80 % for ``hot``, 15 % for ``warm``, 5 % for ``cold``.
- ``iii``: a steady stream for ``stream`` (a request every ``stream_every_s``, each a whole
  generation long, so it never idles while the stream lasts) and a trickle for ``trickle`` (a
  request every ``trickle_every_s``), a budget for one.

Each runs for its window (no request is sent after it; what was sent is waited for).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .load import Ask, agent, paced, poisson

__all__ = ["DEFAULT", "QUICK", "SCENARIOS", "Scenario", "Timing"]


@dataclass(frozen=True, slots=True)
class Timing:
    agents_s: float
    pause_s: float
    skewed_s: float
    rate: float
    trickle_s: float
    stream_every_s: float
    trickle_every_s: float
    trickle_first_s: float
    seed: int = 44


DEFAULT = Timing(
    agents_s=36.0,
    pause_s=0.2,
    skewed_s=30.0,
    rate=2.0,
    trickle_s=30.0,
    stream_every_s=0.5,
    trickle_every_s=10.0,
    trickle_first_s=2.0,
)
QUICK = Timing(
    agents_s=3.0,
    pause_s=0.1,
    skewed_s=2.5,
    rate=4.0,
    trickle_s=3.0,
    stream_every_s=0.25,
    trickle_every_s=1.5,
    trickle_first_s=0.5,
)


@dataclass(frozen=True, slots=True)
class Scenario:
    key: str
    title: str
    names: tuple[str, ...]
    fits: int
    """How many of its deployments the budget holds at once."""
    drive: Callable[[Ask, Timing], Awaitable[None]]
    window: Callable[[Timing], float]


async def _agents(ask: Ask, t: Timing) -> None:
    await asyncio.gather(
        agent(ask, "a", t.agents_s, t.pause_s), agent(ask, "b", t.agents_s, t.pause_s)
    )


async def _skewed(ask: Ask, t: Timing) -> None:
    await poisson(ask, {"hot": 0.80, "warm": 0.15, "cold": 0.05}, t.rate, t.skewed_s, t.seed)


async def _trickle(ask: Ask, t: Timing) -> None:
    await asyncio.gather(
        paced(ask, "stream", 0.0, t.stream_every_s, t.trickle_s),
        paced(ask, "trickle", t.trickle_first_s, t.trickle_every_s, t.trickle_s),
    )


SCENARIOS = (
    Scenario(
        "i",
        "two closed-loop agents on two models, a budget for one",
        ("a", "b"),
        1,
        _agents,
        lambda t: t.agents_s,
    ),
    Scenario(
        "ii",
        "three models, a budget for two, skewed load (80/15/5 %)",
        ("hot", "warm", "cold"),
        2,
        _skewed,
        lambda t: t.skewed_s,
    ),
    Scenario(
        "iii",
        "a steady stream for one model, a trickle for another, a budget for one",
        ("stream", "trickle"),
        1,
        _trickle,
        lambda t: t.trickle_s,
    ),
)
