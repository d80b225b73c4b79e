"""Forwarding one chat request to an engine and relaying or collecting its stream (hot path).

The engine is always asked for a stream. Each block read from it is decoded, every chunk is
verified, and the verified chunks of one block go to the client in one write. Whenever the
exchange ends other than by the engine's ``[DONE]`` (a client hang-up, a deadline, a broken
stream), the engine connection is closed, never returned to the pool: closing it is what tells
the engine to stop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from yarl import URL

from ._assemble import Assembler
from ._config import Deployment
from ._deadline import Deadline
from ._errors import GatewayError, NotAcceptedError, error_body, error_event
from ._permetrics import chat_figures
from ._sse import DONE, SSEDecoder, SSEError
from ._verify import ChunkVerifier, EngineRejectedError, UnverifiedError

__all__ = ["Outcome", "RelayContext", "post_to_engine", "relay_chat"]

logger = logging.getLogger(__name__)

REJECTION_STATUSES = frozenset({400, 413, 422})
MAX_ERROR_BODY = 16 * 1024
MAX_MESSAGE_BYTES = 512
DRAIN_S = 1.0
"""How long a finished exchange waits for the end of the engine's body to pool its connection."""
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
}


@dataclass(slots=True)
class Outcome:
    """How the exchange with the engine ended (read by the caller for accounting and logs)."""

    sent: bool = False
    """The request may have reached the engine."""
    completed: bool = False
    """The engine's answer ended on its own terms ([DONE], or a refusal)."""
    cut: str | None = None
    """Why the gateway cut it short: hang-up, deadline or idle timeout."""
    answered: bool = False
    """The engine produced generated text or an error before the end."""
    error: str | None = None


@dataclass(slots=True)
class RelayContext:
    session: aiohttp.ClientSession
    url: URL
    engine_headers: dict[str, str]
    deployment: Deployment
    response_headers: dict[str, str]
    arrival: float
    """``loop.time()`` when the request arrived: the request deadline counts from here."""
    request_deadline: float
    stream_idle_timeout: float
    outcome: Outcome = field(default_factory=Outcome)
    drains: set[asyncio.Task[None]] = field(default_factory=set)
    """Where the relay parks the tasks that pool an engine connection after the answer left;
    the gateway cancels what is left when it shuts down."""


def _engine_message(raw: bytes) -> str:
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return ""
    message: Any = None
    if isinstance(doc, dict):
        err = doc.get("error")
        message = err.get("message") if isinstance(err, dict) else doc.get("message")
        if message is None and isinstance(err, str):
            message = err
    text = str(message) if message is not None else ""
    return text.encode()[:MAX_MESSAGE_BYTES].decode("utf-8", "ignore")


def _gateway_error_response(err: GatewayError, headers: dict[str, str]) -> web.Response:
    h = dict(headers)
    if err.status == 429:
        h["Retry-After"] = "1"
    return web.Response(
        status=err.status, body=error_body(err), headers=h, content_type="application/json"
    )


async def post_to_engine(ctx: RelayContext, body: dict[str, Any]) -> aiohttp.ClientResponse:
    """Send ``body`` to the engine and return its answer's head. A connection that could not
    even be opened is `NotAcceptedError`: the engine has nothing to stop, and another instance
    may take the request."""
    ctx.outcome.sent = True
    try:
        return await ctx.session.post(ctx.url, data=orjson.dumps(body), headers=ctx.engine_headers)
    except aiohttp.ClientConnectorError as exc:
        ctx.outcome.sent = False
        raise NotAcceptedError(f"the engine could not be reached: {exc}") from exc


async def relay_chat(
    request: web.Request, ctx: RelayContext, body: dict[str, Any], *, stream: bool
) -> web.StreamResponse:
    """Send ``body`` (already addressed to the engine) and answer the client."""
    loop = asyncio.get_running_loop()
    dep = ctx.deployment
    verifier = ChunkVerifier(dep.engine, served=dep.engine_model, public=dep.name)
    decoder = SSEDecoder()
    assembler = None if stream else Assembler()
    out: web.StreamResponse | None = None
    upstream: aiohttp.ClientResponse | None = None
    clean = False
    done = False
    first_deadline = ctx.arrival + ctx.request_deadline
    sent_at = loop.time()
    try:
        with Deadline(first_deadline, first_check=sent_at + ctx.stream_idle_timeout) as bound:
            try:
                upstream = await post_to_engine(ctx, body)
            except aiohttp.ClientError as exc:
                raise GatewayError(
                    502, "engine_error", f"the engine could not be reached: {exc}"
                ) from exc
            if upstream.status != 200:
                ctx.outcome.completed = True  # an answer, not a stream: nothing runs on
                raise await _refusal(upstream)
            ctype = upstream.headers.get("Content-Type", "")
            if not ctype.startswith("text/event-stream"):
                raise GatewayError(
                    502,
                    "engine_error",
                    f"the engine answered {ctype or 'no content type'}, not a stream",
                )
            content = upstream.content
            while not done:
                block = await content.readany()
                if not block:
                    break
                now = loop.time()
                parts: list[bytes] = []
                for data in decoder.feed(block):
                    if data == DONE:
                        done = True
                        break
                    if assembler is None:
                        parts.append(verifier.relay(data, now))
                    else:
                        assembler.add(verifier.collect(data, now))
                if verifier.first_output_at is not None:
                    bound.move(now + ctx.stream_idle_timeout)
                if parts:
                    if out is None:
                        out = await _start_stream(request, ctx)
                    await out.write(b"".join(parts))
            verifier.verify_end(done)
        figures = chat_figures(
            dep.engine,
            engine_objects=verifier.engine_objects,
            usage=verifier.usage,
            sent_at=sent_at,
            first_text_at=verifier.first_text_at,
            last_at=verifier.last_at,
        )
        clean = True
        ctx.outcome.completed = True
        if assembler is not None:
            result = assembler.result()
            result["capyctl"] = {"metrics": figures}
            return web.Response(
                body=orjson.dumps(result),
                headers=ctx.response_headers,
                content_type="application/json",
            )
        if out is None:
            out = await _start_stream(request, ctx)
        # The figures, [DONE] and the end of the chunked body leave in one write.
        await out.write_eof(
            b": x-capyctl-metrics " + orjson.dumps(figures) + b"\n\ndata: [DONE]\n\n"
        )
        return out
    except TimeoutError:
        started = verifier.first_output_at is not None
        ctx.outcome.cut = "idle_timeout" if started else "deadline"
        what = (
            "the engine stream was quiet for longer than queue.stream_idle_timeout"
            if started
            else "no output within queue.request_deadline"
        )
        return await _fail(
            request, ctx, out, GatewayError(503, "unavailable", what, retryable=True)
        )
    except EngineRejectedError as exc:
        ctx.outcome.answered = ctx.outcome.completed = True
        err = GatewayError(
            exc.status,
            "engine_rejected",
            exc.message.encode()[:MAX_MESSAGE_BYTES].decode("utf-8", "ignore"),
        )
        return await _fail(request, ctx, out, err)
    except (UnverifiedError, SSEError) as exc:
        ctx.outcome.error = str(exc)
        logger.warning("engine stream unverified (%s): %s", dep.name, exc)
        if stream:
            return await _fail(
                request,
                ctx,
                out,
                GatewayError(
                    502, "stream_unverified", f"the engine stream failed verification: {exc}"
                ),
                in_band=True,
            )
        return await _fail(
            request,
            ctx,
            out,
            GatewayError(502, "engine_error", f"the engine answer failed verification: {exc}"),
        )
    except GatewayError as err:
        return await _fail(request, ctx, out, err)
    except aiohttp.ClientError as exc:
        ctx.outcome.error = str(exc)
        return await _fail(
            request,
            ctx,
            out,
            GatewayError(502, "engine_error", f"the engine connection failed: {exc}"),
        )
    except asyncio.CancelledError:
        ctx.outcome.cut = "hang_up"  # aiohttp cancels the handler when the client goes away
        raise
    except ConnectionResetError:
        ctx.outcome.cut = "hang_up"  # noticed by a write before the cancellation
        return out if out is not None else web.Response(status=499)
    finally:
        ctx.outcome.answered = ctx.outcome.answered or verifier.answered
        if upstream is not None:
            if not clean:
                upstream.close()  # never back to the pool: the engine sees the close and stops
            elif upstream.content.is_eof():
                upstream.release()
            else:  # the answer is complete; wait for the body's end without holding it up
                task = loop.create_task(_release_when_ended(upstream))
                ctx.drains.add(task)
                task.add_done_callback(ctx.drains.discard)


async def _release_when_ended(upstream: aiohttp.ClientResponse) -> None:
    """Pool the engine connection once its chunked body has ended after ``[DONE]``.

    uvicorn (vLLM, SGLang) writes that end on its own, after ``[DONE]``; a connection released
    before it arrives is closed rather than pooled, and the next request pays for a new one.
    This runs after the client has its answer and the request has left the queue. Nothing but
    the end may come: more data, none within `DRAIN_S`, or a shutdown closes the connection.
    """
    ended = False
    try:
        with Deadline(asyncio.get_running_loop().time() + DRAIN_S):
            ended = not await upstream.content.readany() and upstream.content.is_eof()
    except (TimeoutError, aiohttp.ClientError):
        pass
    finally:
        if ended:
            upstream.release()
        else:
            upstream.close()


async def _start_stream(request: web.Request, ctx: RelayContext) -> web.StreamResponse:
    out = web.StreamResponse(status=200, headers={**SSE_HEADERS, **ctx.response_headers})
    await out.prepare(request)
    return out


async def _fail(
    request: web.Request,
    ctx: RelayContext,
    out: web.StreamResponse | None,
    err: GatewayError,
    *,
    in_band: bool = False,
) -> web.StreamResponse:
    """Answer ``err``: as an HTTP error if nothing was sent yet, else as an in-band event."""
    if out is None and not in_band:
        return _gateway_error_response(err, ctx.response_headers)
    if out is None:
        out = await _start_stream(request, ctx)
    await out.write(error_event(err))
    await out.write_eof()
    return out


async def _refusal(upstream: aiohttp.ClientResponse) -> GatewayError:
    """The error for a non-200 engine answer: its own refusals keep their status."""
    raw = b""
    if upstream.status in REJECTION_STATUSES:
        try:
            raw = await asyncio.wait_for(upstream.content.read(MAX_ERROR_BODY), 5)
        except (TimeoutError, aiohttp.ClientError):
            raw = b""
        ctype = upstream.headers.get("Content-Type", "")
        if "json" in ctype and raw:
            return GatewayError(
                upstream.status, "engine_rejected", _engine_message(raw) or "rejected by the engine"
            )
    return GatewayError(502, "engine_error", f"the engine answered {upstream.status}")
