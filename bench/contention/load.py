"""The clients of the contention benchmark: closed-loop agents, open-loop streams, and the one
streamed request each sends, timed from sending to its first chunk (its wait: the queue, the
switches and the start or wake it waited for) and to its last."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["Ask", "Sent", "agent", "paced", "poisson"]


@dataclass(frozen=True, slots=True)
class Sent:
    deployment: str
    at_s: float
    """When it was sent, from the window's start."""
    wait_s: float | None
    """Seconds to its first chunk (None: none came)."""
    total_s: float | None
    """Seconds to its last byte, when answered whole (None: not)."""
    status: int | None
    error: str | None = None


@dataclass
class Ask:
    """Sends one streamed request at a time for any deployment, and keeps each one's record."""

    client: httpx.AsyncClient
    url: str
    body: Callable[[str], dict[str, Any]]
    """A deployment's name -> the request's body."""
    whole: Callable[[str, str], bool]
    """(the answer's text, the deployment's name) -> whether it is whole and from it."""
    t0: float = field(default_factory=time.monotonic)
    sent: list[Sent] = field(default_factory=list)
    started: int = 0
    """Requests sent, answered or not (one cut off by the run's end has no `Sent`)."""

    def restart(self) -> None:
        """The window starts now: what was sent before (the warm-up) is forgotten."""
        self.t0, self.sent, self.started = time.monotonic(), [], 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def __call__(self, deployment: str) -> bool:
        """Send it, wait for the whole answer; whether it came whole."""
        self.started += 1
        at = self.now()
        began = time.monotonic()
        first: float | None = None
        status: int | None = None
        parts: list[str] = []
        try:
            async with self.client.stream("POST", self.url, json=self.body(deployment)) as r:
                status = r.status_code
                async for text in r.aiter_text():
                    if first is None and "data:" in text:
                        first = time.monotonic() - began
                    parts.append(text)
        except httpx.HTTPError as err:
            self.sent.append(Sent(deployment, at, first, None, status, repr(err)))
            return False
        text = "".join(parts)
        ok = status == 200 and self.whole(text, deployment)
        took = time.monotonic() - began
        error = None if ok else f"{status}: {text[-300:]}"
        self.sent.append(Sent(deployment, at, first, took if ok else None, status, error))
        return ok


async def agent(ask: Ask, deployment: str, until_s: float, pause_s: float) -> None:
    """A closed-loop client (a coding agent): its next request once the last is answered and
    its tool ran (``pause_s``), until ``until_s``. It stops at its first failure."""
    while ask.now() < until_s:
        if not await ask(deployment):
            return
        await asyncio.sleep(pause_s)  # the agent's own pace: its tools run


async def paced(ask: Ask, deployment: str, first_s: float, every_s: float, until_s: float) -> None:
    """An open-loop client: a request at ``first_s`` and every ``every_s`` after, until
    ``until_s``, each sent whether or not the last was answered."""
    tasks = []
    at = first_s
    while at < until_s:
        await asyncio.sleep(max(at - ask.now(), 0.0))  # the stream's own pace
        tasks.append(asyncio.create_task(ask(deployment)))
        at += every_s
    await asyncio.gather(*tasks)


async def poisson(
    ask: Ask, weights: dict[str, float], rate: float, until_s: float, seed: int
) -> None:
    """Open-loop arrivals at ``rate`` a second (exponential gaps, seeded), each for a
    deployment drawn by ``weights``, until ``until_s``."""
    rng = random.Random(seed)
    names, shares = list(weights), list(weights.values())
    tasks = []
    at = rng.expovariate(rate)
    while at < until_s:
        await asyncio.sleep(max(at - ask.now(), 0.0))  # the arrivals' own pace
        tasks.append(asyncio.create_task(ask(rng.choices(names, shares)[0])))
        at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
