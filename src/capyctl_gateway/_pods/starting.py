"""Waiting for a pod to start: its Ready condition on the namespace's watch, then the engine's
own ``/health`` at the pod's address, asked by the gateway itself (the network path its
requests will take, which the kubelet's probe does not prove)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import aiohttp

from .._errors import StartFailedError
from .manifest import HEALTH_PATH
from .podstate import ended, pending, ready, terminating
from .watch import PodWatch

__all__ = ["HEALTH_WITHIN_S", "healthy", "until_ready"]

logger = logging.getLogger("capyctl_gateway")

HEALTH_WITHIN_S = 30.0
"""How long the gateway asks a pod the kubelet calls ready for its ``/health`` itself."""


async def until_ready(
    w: PodWatch,
    current: Callable[[], dict[str, Any] | None],
    name: str,
    within_s: float,
) -> dict[str, Any]:
    """The pod once it is ready. Raises StartFailedError when it ended, was deleted, or was not
    ready ``within_s`` (saying why it waited: the scheduler's or the kubelet's reason)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    said: str | None = None
    seen = False
    while True:
        pod = current()
        if pod is None and seen and w.current:
            raise StartFailedError(f"its pod {name} was deleted as it started")
        if pod is not None:
            seen = True
            if (why := ended(pod)) is not None:
                raise StartFailedError(f"its pod {name} did not start: {why}")
            if terminating(pod):
                raise StartFailedError(f"its pod {name} was deleted as it started")
            if ready(pod):
                return pod
            why = pending(pod, detail=False)  # what a failed start tells clients
            if why is not None and why != said:
                logger.warning("its pod %s waits: %s", name, pending(pod))
            said = why
        left = deadline - loop.time()
        if left <= 0:
            raise StartFailedError(
                f"its pod {name} was not ready within launch.startup_timeout"
                + (f" ({said})" if said else "")
            )
        try:
            await asyncio.wait_for(w.changed(), left)
        except TimeoutError:
            continue


async def healthy(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], name: str
) -> None:
    """Return once the engine at ``url`` answers its ``/health`` 200 to the gateway."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HEALTH_WITHIN_S
    timeout = aiohttp.ClientTimeout(total=5)
    while True:
        try:
            async with session.get(url + HEALTH_PATH, headers=headers, timeout=timeout) as resp:
                if resp.status == 200:
                    return
        except (aiohttp.ClientError, TimeoutError, OSError):
            pass
        if loop.time() >= deadline:
            raise StartFailedError(
                f"its pod {name} is ready, but its engine does not answer the gateway"
            )
        await asyncio.sleep(0.2)
