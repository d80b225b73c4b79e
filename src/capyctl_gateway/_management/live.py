"""What the console reads beyond the status documents, each with the gateway's key: the live
event stream, a launched engine's last log lines, and every deployment's recent window.

``GET /management/v1/events`` is a server-sent event stream of the gateway's events
(``_events.py``: at most `MAX_SUBSCRIBERS` streams, each dropped once `QUEUE_EVENTS` wait for
it), with ``?recent=1`` beginning with the last `RECENT_EVENTS` not about one request; a
comment every `HEARTBEAT_S` keeps it open, a client that hangs up frees its slot within
`HANGUP_CHECK_S`, and a write that waits `WRITE_TIMEOUT_S` for a reader ends it.
``GET /management/v1/deployments/{name}/instances/{index}/log`` answers at most `LOG_MAX_LINES`
lines and `LOG_MAX_BYTES` bytes of the engine's latest run, masked.
``GET /management/v1/recent`` answers each deployment's last minutes (`Recent`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from .._errors import GatewayError, InvalidRequestError, UnknownModelError
from .._events import BUS, MAX_SUBSCRIBERS, QUEUE_EVENTS, RECENT_EVENTS, EventBus, Subscription
from .._gateway import Gateway
from .._loop import running_loop
from .._telemetry import RECENT_SLOT_S, RECENT_SLOTS, Slot
from .._ulid import REQUEST_ID
from .keyed import keyed

__all__ = [
    "HANGUP_CHECK_S",
    "HEARTBEAT_S",
    "LOG_LINES",
    "LOG_LINES_DIGITS",
    "LOG_MAX_BYTES",
    "LOG_MAX_LINES",
    "MAX_SUBSCRIBERS",
    "QUEUE_EVENTS",
    "RECENT_EVENTS",
    "WRITE_TIMEOUT_S",
    "add_live_routes",
    "recent_doc",
    "window_totals",
]

HEARTBEAT_S = 15.0
"""A comment line on a quiet event stream this often."""
HANGUP_CHECK_S = 0.5
"""How often a quiet event stream looks whether its client hung up (the listener does not
cancel its handlers, so a hang-up is otherwise noticed at the next write), freeing its slot."""
WRITE_TIMEOUT_S = 30.0
"""An event stream whose reader takes nothing for this long is closed."""
LOG_LINES = 100
"""Log lines answered when ``lines`` is not given."""
LOG_MAX_LINES = 1000
"""The most log lines one answer holds (a larger ``lines`` is cut to it)."""
LOG_MAX_BYTES = 64 * 1024
"""The most bytes of a log one answer reads."""
LOG_LINES_DIGITS = 6
"""The most digits ``lines`` may have (ASCII ones only); a longer value is a 400."""


def add_live_routes(app: web.Application, gateway: Gateway, bus: EventBus = BUS) -> None:
    """Add the event stream, the log lines and the recent windows to ``app``."""
    streams: set[Subscription] = set()

    async def events(request: web.Request, rid: str) -> web.StreamResponse:
        sub = bus.subscribe(recent=request.query.get("recent") == "1")
        if sub is None:
            raise GatewayError(
                f"{bus.max_subscribers} event streams are open already; close one first",
                status=503,
                code="too_many_subscribers",
                retryable=True,
            )
        streams.add(sub)
        try:
            return await _stream(request, rid, sub)
        finally:
            streams.discard(sub)
            bus.unsubscribe(sub)

    async def closing(_app: web.Application) -> None:
        for sub in list(streams):
            sub.end("the gateway is stopping")

    async def log(request: web.Request, rid: str) -> dict[str, Any]:
        return await _log_lines(gateway, request)

    async def recent(request: web.Request, rid: str) -> dict[str, Any]:
        return recent_doc(gateway)

    app.on_shutdown.append(closing)
    app.router.add_get("/management/v1/events", keyed(gateway, events))
    app.router.add_get(
        "/management/v1/deployments/{name}/instances/{index:[0-9]{1,4}}/log", keyed(gateway, log)
    )
    app.router.add_get("/management/v1/recent", keyed(gateway, recent))


async def _stream(request: web.Request, rid: str, sub: Subscription) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            REQUEST_ID: rid,
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-store",
            "X-Accel-Buffering": "no",
        }
    )
    resp.force_close()  # the connection ends with the stream
    await resp.prepare(request)
    try:
        await _write(resp, b": capyctl events\n\n")
        loop = running_loop()
        beat_at = loop.time() + HEARTBEAT_S
        while True:
            items = await sub.take(max(0.0, min(HANGUP_CHECK_S, beat_at - loop.time())))
            if items:
                await _write(resp, b"".join(b"data: " + i + b"\n\n" for i in items))
            elif sub.ended is not None:
                end = orjson.dumps({"reason": sub.ended})
                await _write(resp, b"event: end\ndata: " + end + b"\n\n")
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    await resp.write_eof()
                break
            elif request.transport is None or request.transport.is_closing():
                break  # the client hung up: its slot is free at once
            elif loop.time() >= beat_at:
                await _write(resp, b": keep-alive\n\n")
                beat_at = loop.time() + HEARTBEAT_S
    except (TimeoutError, ConnectionError):
        if request.transport is not None:  # a reader that takes nothing: nothing more to say
            request.transport.abort()
    return resp


async def _write(resp: web.StreamResponse, data: bytes) -> None:
    async with asyncio.timeout(WRITE_TIMEOUT_S):
        await resp.write(data)


async def _log_lines(gateway: Gateway, request: web.Request) -> dict[str, Any]:
    name, index = request.match_info["name"], int(request.match_info["index"])
    raw = request.query.get("lines", str(LOG_LINES))
    if not (raw.isascii() and raw.isdigit() and len(raw) <= LOG_LINES_DIGITS):
        raise InvalidRequestError("lines takes a whole number")
    count = min(int(raw), LOG_MAX_LINES)
    route = gateway.fleet.routes.get(name)
    if route is None:
        raise UnknownModelError(f"no deployment named {name!r}")
    if index >= len(route.instances):
        raise GatewayError(
            f"deployment {name} has no instance {index}", status=404, code="not_found"
        )
    inst = route.instances[index]
    runner = inst.runner
    if inst.launch is None:
        raise GatewayError(
            f"deployment {name} is an engine someone else runs (url:): its log is theirs",
            status=409,
            code="deployment_not_launched",
        )
    log = runner.log()  # raises where the log is kept elsewhere (log_on_host)
    if log is None:
        return {"deployment": name, "instance": index, "lines": [], "never_ran": True}
    lines = await log.lines(count, LOG_MAX_BYTES)
    return {"deployment": name, "instance": index, "lines": lines}


def recent_doc(gateway: Gateway) -> dict[str, Any]:
    """Every deployment's recent window: per slot, oldest first, its length in seconds (the
    current one is partial), requests ended, errors, and the mean of the answers' times to
    first token and of the waits for a start or wake, each with its count (a mean is left out
    where nothing was timed); and per deployment the whole window's (`window_totals`)."""
    telemetry, now = gateway.telemetry, running_loop().time()
    out: dict[str, list[dict[str, Any]]] = {}
    totals: dict[str, dict[str, Any]] = {}
    for d in gateway.config.deployments:
        slots = telemetry.window(d.name, now).slots(now)
        out[d.name] = [_row(s) for s in slots]
        totals[d.name] = window_totals(slots)
    return {
        "slot_s": RECENT_SLOT_S,
        "slots": RECENT_SLOTS,
        "deployments": out,
        "totals": totals,
    }


def window_totals(slots: list[Slot]) -> dict[str, Any]:
    """A window's seconds, requests and errors, and its timings weighted by requests: each
    mean is the sum over every slot divided by the count over every slot (a slot of one slow
    request weighs as one request, not as a slot of many)."""
    return _row(
        Slot(
            round(sum(s.seconds for s in slots), 3),
            sum(s.requests for s in slots),
            sum(s.errors for s in slots),
            sum(s.ttft_sum for s in slots),
            sum(s.ttft_n for s in slots),
            sum(s.wake_sum for s in slots),
            sum(s.wake_n for s in slots),
        )
    )


def _row(s: Slot) -> dict[str, Any]:
    row: dict[str, Any] = {"s": s.seconds, "requests": s.requests, "errors": s.errors}
    if s.ttft_n:
        row["ttft_s"], row["ttft_n"] = round(s.ttft_sum / s.ttft_n, 6), s.ttft_n
    if s.wake_n:
        row["wake_s"], row["wake_n"] = round(s.wake_sum / s.wake_n, 6), s.wake_n
    return row
