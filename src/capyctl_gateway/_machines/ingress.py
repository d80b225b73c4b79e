"""A host's ingress: the one door through which the server reaches the host's engines.

``POST /i/<deployment>/<index>/v1/chat/completions`` (and ``/v1/systemone``) with exactly one
``Authorization: Bearer <gate key>``, the key the host reported for that instance on the control
session. Anything else is refused, with `NOT_FORWARDED` set so that the server knows the engine
never saw it: a missing key, or one no open gate has (401, decided before the path is looked at,
so that nobody without a key learns which instances are here), an unknown instance (404), another
instance's key or a closed gate's (401), a query string or a compressed body (400), a body
over `INGRESS_MAX_BODY_BYTES` (413), an engine that cannot be reached (502). An accepted request
goes to the engine with the engine's own key, and its answer comes back byte for byte. When the
server's connection goes away, the ingress closes the engine connection (that is the engine's
signal to stop); when the control session is lost, it closes every forward.

A body is streamed to the engine as it arrives, byte for byte, never held whole: its length is the
request's ``Content-Length`` (the server always sends one), at most 8 MiB and 64 KiB (the
client's 8 MiB and room for the server's rewrite); a request without one is refused (411
``length_required``, not forwarded), as is one over the limit (413), before the engine is
contacted.

Bind it to a private address that only the server can reach (docs/gateway/machines.md has the
firewall rule). Never imports the HTTP surface, the relay or the lifecycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from .protocol import INGRESS_MAX_BODY_BYTES, NOT_FORWARDED

__all__ = ["MAX_FORWARDS", "Gate", "create_ingress_app"]

MAX_FORWARDS = 256
"""Requests forwarded at once, over all instances; past it, 503 (not forwarded)."""
_ENDPOINTS = {"v1/chat/completions", "v1/systemone"}


@dataclass(eq=False)
class Gate:
    """What the ingress needs of one instance."""

    url: str | None
    """The engine's origin on this host (None while it has no process)."""
    headers: dict[str, str] = field(repr=False)
    """Sent to the engine (its own key among them)."""
    key: str | None = field(repr=False)
    """The gate key while the gate is open; None while it is closed."""
    in_flight: int = 0
    last_end: float = 0.0
    """When its latest forward ended (wall clock, as the collector's samples)."""
    forwards: set[asyncio.Task[object]] = field(default_factory=set)


def _refuse(status: int, code: str, message: str) -> web.Response:
    return web.json_response(
        {"code": code, "message": message}, status=status, headers={NOT_FORWARDED: code}
    )


def _same(shown: bytes, key: str) -> bool:
    return hmac.compare_digest(shown, f"Bearer {key}".encode())


def create_ingress_app(
    gates: Callable[[], Mapping[tuple[str, int], Gate]],
    session: Callable[[], aiohttp.ClientSession | None],
) -> web.Application:
    """The ingress over ``gates()``, each instance's by (deployment tag, index); serve it with
    handler cancellation on (``web.AppRunner(app, handler_cancellation=True)``), so a server
    that hangs up cancels the forward."""
    busy = [0]

    async def forward(request: web.Request) -> web.StreamResponse:
        # The key first, against every open gate, so that an answer tells one without a key
        # nothing of which instances are here.
        held = gates()
        keys = request.headers.getall("Authorization", [])
        shown = keys[0].encode() if len(keys) == 1 else b""
        keyed = [g for g in held.values() if g.key is not None and _same(shown, g.key)]
        if not keyed:
            return _refuse(401, "unauthorized", "missing or wrong gate key")
        info = request.match_info
        tail = info["tail"]
        try:
            index = int(info["index"])
        except ValueError:
            index = -1
        gate = held.get((info["deployment"], index)) if tail in _ENDPOINTS else None
        if gate is None:
            return _refuse(404, "not_found", "no such instance here")
        if gate is not keyed[0]:
            return _refuse(401, "unauthorized", "missing or wrong gate key")
        if request.query_string or "Content-Encoding" in request.headers:
            return _refuse(400, "bad_request", "no query string, no compressed body")
        length = request.content_length
        if length is None or "Transfer-Encoding" in request.headers:
            return _refuse(411, "length_required", "a request body needs a Content-Length")
        if length > INGRESS_MAX_BODY_BYTES:
            return _refuse(413, "request_too_large", "over the ingress's body limit")
        if busy[0] >= MAX_FORWARDS or gate.url is None:
            return _refuse(503, "shutting_down", "the ingress takes no more requests now")
        client = session()
        if client is None:
            return _refuse(503, "shutting_down", "the host is stopping")
        busy[0] += 1
        gate.in_flight += 1
        task = asyncio.current_task()
        assert task is not None
        gate.forwards.add(task)
        try:
            headers = {**gate.headers, "Content-Length": str(length)}
            return await _relay(request, client, f"{gate.url}/{tail}", headers)
        finally:
            gate.forwards.discard(task)
            gate.in_flight -= 1
            gate.last_end = time.time()
            busy[0] -= 1

    app = web.Application(client_max_size=INGRESS_MAX_BODY_BYTES)
    app.router.add_post("/i/{deployment}/{index}/{tail:.*}", forward)
    return app


async def _relay(
    request: web.Request,
    client: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
) -> web.StreamResponse:
    # The body goes on as it comes (aiohttp reads the request's exactly Content-Length bytes,
    # and sends them under that same length): no copy of it is held.
    try:
        resp = await client.post(url, data=request.content, headers=headers, allow_redirects=False)
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
        return _refuse(502, "engine_unreachable", "the engine could not be reached")
    try:
        out = web.StreamResponse(status=resp.status)
        for name in ("Content-Type",):
            if name in resp.headers:
                out.headers[name] = resp.headers[name]
        await out.prepare(request)
        async for chunk in resp.content.iter_any():
            await out.write(chunk)
        await out.write_eof()
        return out
    except ConnectionResetError:  # the server hung up: nobody left to answer, nothing failed
        return out
    finally:
        # Read to its end: pooled; anything else (the server hung up, the engine broke off):
        # closed, which tells the engine to stop.
        if resp.content.is_eof():
            resp.release()
        else:
            resp.close()


def close_all(gates: list[Gate]) -> None:
    """The control session is lost: end every forward (each closes its engine connection)."""
    for gate in gates:
        for task in list(gate.forwards):
            with contextlib.suppress(RuntimeError):
                task.cancel()
