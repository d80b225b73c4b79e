"""Engines a previous run left: a gateway killed outright leaves its engines to their reapers,
which give each up to 10 s to stop. A gateway started again at once must not launch a second
engine for an instance while the first still holds its memory (a GPU's, most of all).

While it runs, each local runner records its engine process in the gateway's store once it
answers and forgets it once it is stopped (pid and start time: a pid the kernel gave to
another process since is not mistaken for it);
when it starts, before anything can launch, it waits for each recorded engine that still runs
to be gone, up to `OUTLAST_S`, then kills its process group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal

from .._clock import stamp
from .._store import Store
from .process import gone_within

__all__ = ["OUTLAST_S", "outlast", "remember", "started_ticks"]

logger = logging.getLogger("capyctl_gateway")
OUTLAST_S = 15.0
"""How long a starting gateway waits for a previous run's engine (its reaper's grace, 10 s,
and some) before it kills the engine's group."""


def started_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc``); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19]) if fields[0] != "Z" else None


def remember(store: Store | None, key: str, pid: int | None) -> None:
    """Record instance ``key``'s engine process ``pid`` (None: it is provably gone)."""
    if store is None:
        return
    ticks = started_ticks(pid) if pid else None
    if pid and ticks is not None:
        store.engine_up(key, pid, ticks)
    elif pid is None:
        store.engine_down(key)


async def outlast(store: Store, within: float = OUTLAST_S) -> None:
    """Wait until no engine a previous run recorded still runs; kill what outlives ``within``."""
    left = {
        key: pid
        for key, (pid, ticks) in store.engines().items()
        if started_ticks(pid) == ticks  # the same process, not a reused pid
    }
    if left:
        logger.warning(
            "waiting for %d engine(s) a previous run left to stop (%s) before starting any",
            len(left),
            ", ".join(f"{key}: pid {pid}" for key, pid in sorted(left.items())),
        )
    began = stamp()
    for key, pid in left.items():
        if not await gone_within(pid, max(within - (stamp() - began), 0.0)):
            logger.warning("%s: the engine a previous run left (pid %d) is killed", key, pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            await gone_within(pid, 5.0)
    for key in store.engines():
        store.engine_down(key)
