"""Parking and waking an engine whose process stays up (vLLM sleep mode).

vLLM 0.31.0, launched with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``: ``POST
/sleep?level=1`` offloads its weights to host memory and drops its KV cache; ``POST /wake_up``
brings them back; ``GET /is_sleeping`` says which. Each takes the engine's key like any route.
"""

from __future__ import annotations

import aiohttp

from .._engines import EngineKind

__all__ = ["ParkFailedError", "put_to_sleep", "wake_up"]

PARK_TIMEOUT_S = 600.0


class ParkFailedError(Exception):
    """The engine did not park or wake as asked."""


async def _post(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> None:
    try:
        async with session.post(
            url, headers=headers, timeout=aiohttp.ClientTimeout(total=PARK_TIMEOUT_S)
        ) as resp:
            if resp.status != 200:
                raise ParkFailedError(f"{url.rsplit('/', 1)[1]} answered HTTP {resp.status}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ParkFailedError(f"{url.rsplit('/', 1)[1]} failed: {exc}") from exc


async def _sleeping(session: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> bool:
    try:
        async with session.get(f"{base}/is_sleeping", headers=headers) as resp:
            doc = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise ParkFailedError(f"is_sleeping failed: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("is_sleeping"), bool):
        raise ParkFailedError("is_sleeping did not say")
    return bool(doc["is_sleeping"])


async def put_to_sleep(
    session: aiohttp.ClientSession, kind: EngineKind, base: str, headers: dict[str, str]
) -> None:
    if kind is not EngineKind.VLLM:
        raise ParkFailedError(f"{kind.value} cannot be parked with its process up")
    await _post(session, f"{base}/sleep?level=1", headers)
    if not await _sleeping(session, base, headers):
        raise ParkFailedError("the engine says it is not sleeping after /sleep")


async def wake_up(
    session: aiohttp.ClientSession, kind: EngineKind, base: str, headers: dict[str, str]
) -> None:
    if kind is not EngineKind.VLLM:
        raise ParkFailedError(f"{kind.value} cannot be woken")
    await _post(session, f"{base}/wake_up", headers)
    if await _sleeping(session, base, headers):
        raise ParkFailedError("the engine says it is still sleeping after /wake_up")
