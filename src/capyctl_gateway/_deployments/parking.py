"""Parking and waking an engine whose process stays up.

- vLLM 0.31.0, launched with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``: ``POST
  /sleep?level=1`` offloads its weights to host memory and drops its KV cache; ``POST /wake_up``
  brings them back; ``GET /is_sleeping`` says which.
- llama.cpp b10798 in router mode (``--models-dir``): ``POST /models/unload`` ends the model's
  child process (all its memory goes; the router stays up) and answers before the child has
  gone, so the park waits until ``GET /v1/models`` says ``unloaded``; ``POST /models/load``
  starts a new child, and the wake waits for ``loaded``.
- SGLang 0.5.21, launched with ``--enable-memory-saver``: ``POST /release_memory_occupation``
  with ``{}`` (every tag: weights, KV cache, CUDA graphs) releases its GPU memory, ``POST
  /resume_memory_occupation`` with ``{}`` takes it back. It has no route that says which state
  it is in: a 200 is the proof.

Each call takes the engine's key like any route.
"""

from __future__ import annotations

import asyncio

import aiohttp

from .._clock import stamp
from .._engines import EngineKind, facts
from .._errors import ParkFailedError

__all__ = ["ParkFailedError", "drive"]

PARK_TIMEOUT_S = 600.0
STATUS_EVERY_S = 0.2
"""How often a router's model status is read while it loads or unloads (it cannot tell us)."""


async def _post(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    json: dict[str, str] | None = None,
) -> None:
    try:
        async with session.post(
            url, headers=headers, json=json, timeout=aiohttp.ClientTimeout(total=PARK_TIMEOUT_S)
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


async def _router_status(
    session: aiohttp.ClientSession, base: str, headers: dict[str, str], model: str
) -> str:
    try:
        async with session.get(f"{base}/v1/models", headers=headers) as resp:
            doc = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise ParkFailedError(f"v1/models failed: {exc}") from exc
    for entry in doc.get("data", []) if isinstance(doc, dict) else []:
        if isinstance(entry, dict) and entry.get("id") == model:
            status = entry.get("status")
            value = status.get("value") if isinstance(status, dict) else None
            return str(value)
    raise ParkFailedError(f"the router does not list {model!r}")


async def _router_until(
    session: aiohttp.ClientSession, base: str, headers: dict[str, str], model: str, want: str
) -> None:
    end = stamp() + PARK_TIMEOUT_S
    while (status := await _router_status(session, base, headers, model)) != want:
        if status not in ("loading", "loaded", "unloaded", "sleeping"):
            raise ParkFailedError(f"the router says {model!r} is {status}")
        if stamp() > end:
            raise ParkFailedError(f"{model!r} was not {want} within {PARK_TIMEOUT_S:.0f} s")
        await asyncio.sleep(STATUS_EVERY_S)


async def drive(
    session: aiohttp.ClientSession,
    kind: EngineKind,
    base: str,
    headers: dict[str, str],
    router_model: str | None,
    *,
    park: bool,
) -> None:
    """Park (or wake) one engine the way its kind allows (`EngineFacts.park_by`), and check
    it took effect."""
    if kind is EngineKind.LLAMACPP and router_model is not None:
        route, want = ("unload", "unloaded") if park else ("load", "loaded")
        await _post(session, f"{base}/models/{route}", headers, {"model": router_model})
        await _router_until(session, base, headers, router_model, want)
        return
    by = facts(kind).park_by
    if by is None:
        raise ParkFailedError(f"{kind.value} cannot be parked with its process up")
    await _DRIVERS[by](session, base, headers, park)


async def _sleep(
    session: aiohttp.ClientSession, base: str, headers: dict[str, str], park: bool
) -> None:
    """vLLM's sleep mode: ``/sleep?level=1`` or ``/wake_up``, then ``/is_sleeping`` says so."""
    await _post(session, f"{base}/sleep?level=1" if park else f"{base}/wake_up", headers)
    if await _sleeping(session, base, headers) is not park:
        raise ParkFailedError(
            "the engine says it is "
            + ("not sleeping after /sleep" if park else "still sleeping after /wake_up")
        )


async def _release(
    session: aiohttp.ClientSession, base: str, headers: dict[str, str], park: bool
) -> None:
    """SGLang's memory release: ``/release_memory_occupation`` or ``/resume_...``."""
    route = "release" if park else "resume"
    await _post(session, f"{base}/{route}_memory_occupation", headers, {})


_DRIVERS = {"sleep": _sleep, "release": _release}
"""How each `EngineFacts.park_by` parks and wakes an engine."""
