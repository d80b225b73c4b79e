"""A chat answer: relayed chunk by chunk to a streaming client, or collected (hot path).

The engine is always asked for a stream (an `Exchange`). Each block read from it is decoded,
every chunk verified, and the verified chunks of one block leave in one write. For a client
that did not ask for a stream the chunks are assembled into one answer instead. What can go
wrong is mapped by the exchange; this module decides only how the client hears of it: an HTTP
error while nothing was written, else one in-band error event.
"""

from __future__ import annotations

import logging

import orjson
from aiohttp import web

from .. import _clock
from .._aiohttp import HeadWithFirstWrite
from .._config import Deployment
from .._errors import (
    ClientGoneError,
    EngineError,
    GatewayError,
    NotAcceptedError,
    UnverifiedError,
    error_event,
)
from .assemble import Assembler, Folding
from .blocks import BlockReader
from .exchange import Exchange
from .figures import Figures, chat_figures
from .pump import Fold, pump_rest, pumpable
from .verify import ChunkVerifier

__all__ = [
    "SSE_HEADERS",
    "answer_figures",
    "client_gone",
    "collect_chat",
    "fold",
    "note_outcome",
    "relay_chat",
    "start_stream",
    "stream_end",
    "stream_error",
    "stream_reader",
    "unverified",
]

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


async def relay_chat(
    request: web.Request,
    ex: Exchange,
    dep: Deployment,
    payload: bytes,
    *,
    headers: dict[str, str],
) -> web.StreamResponse:
    """Relay the engine's stream to a streaming client, chunk by verified chunk."""
    reader = stream_reader(dep)
    verifier = reader.verifier
    out: web.StreamResponse | None = None
    sent_at = _clock.now()
    try:
        async with ex:
            content = await ex.open_stream(payload)
            done = False
            last: list[bytes] = []
            while not done and (block := await content.readany()):
                now = _clock.now()
                parts, done = reader.relay(block, now)
                if parts:
                    if verifier.first_output_at is not None:
                        ex.output(now)  # only relayed output keeps a stream alive, not pings
                    if done and verifier.finished:
                        last = parts  # the answer is whole: these leave with its end
                        break
                    ex.writing = True  # bounded by the idle deadline, like the engine's output
                    if out is None:
                        out = await start_stream(request, headers)
                    await out.write(b"".join(parts))
                    ex.writing = False
                    if not done and pumpable(out):
                        done, last = await pump_rest(content, reader, ex, out)
                        break
            verifier.verify_end(done)
            ex.complete()
            if out is None:
                out = await start_stream(request, headers)
            ex.writing = True
            await out.write_eof(stream_end(last, answer_figures(ex, dep, verifier, sent_at)))
            ex.writing = False
        return out
    except (ClientGoneError, ConnectionResetError):
        return client_gone(request, ex, out)
    except NotAcceptedError:
        raise
    except UnverifiedError as exc:
        return await stream_error(request, out, unverified(ex, exc), headers)
    except GatewayError as err:
        if out is None:
            raise  # nothing written yet: the HTTP surface answers it
        return await stream_error(request, out, err, headers)
    finally:
        note_outcome(ex, verifier)


def stream_end(last: list[bytes], figures: Figures) -> bytes:
    """What ends a verified chat stream, in one write with the end of the chunked body (and
    with the head too when the whole answer came in one read): its ``last`` events, the
    answer's ``figures`` as a comment, and ``[DONE]``."""
    last += (b": x-capyctl-metrics ", orjson.dumps(figures), b"\n\ndata: [DONE]\n\n")
    return b"".join(last)


async def collect_chat(ex: Exchange, dep: Deployment, payload: bytes, *, max_bytes: int) -> bytes:
    """Collect the engine's stream into one chat answer for a client that asked for none;
    returns the answer's JSON bytes. An answer whose chunks pass ``max_bytes`` is refused."""
    assembler = Assembler()
    verifier, sent_at = await fold(ex, dep, payload, assembler, max_bytes)
    result = assembler.result()
    result["capyctl"] = {"metrics": answer_figures(ex, dep, verifier, sent_at)}
    return orjson.dumps(result)


async def fold(
    ex: Exchange, dep: Deployment, payload: bytes, into: Folding, max_bytes: int
) -> tuple[ChunkVerifier, float]:
    """Fold the engine's stream into ``into`` (a chat answer, or a Response) for a client that
    asked for no stream: its verifier (what the figures read) and when the engine was asked.
    A stream that fails verification is the engine's failure (502); one past ``max_bytes``
    is refused."""
    reader = stream_reader(dep)
    verifier = reader.verifier
    sent_at = _clock.now()
    try:
        async with ex:
            content = await ex.open_stream(payload)
            done = await Fold(reader, ex, into, max_bytes).read(content)
            verifier.verify_end(done)
            ex.complete()
    except UnverifiedError as exc:
        logger.warning("engine answer unverified (%s): %s%s", ex.where, exc, _said(exc))
        message = f"the engine answer failed verification: {exc}"
        raise EngineError(message, detail=exc.detail) from exc
    finally:
        note_outcome(ex, verifier)
    return verifier, sent_at


def stream_reader(dep: Deployment) -> BlockReader:
    """The reader and verifier of one answer of ``dep``'s engine, its model renamed to the
    deployment's (``reader.verifier``)."""
    hide = dep.cached_tokens == "withheld"
    return BlockReader(
        ChunkVerifier(dep.engine, served=dep.engine_model, public=dep.name, hide=hide)
    )


def client_gone(
    request: web.Request, ex: Exchange, out: web.StreamResponse | None
) -> web.StreamResponse:
    """What a stream whose client went answers (nobody reads it): a write it stopped reading
    is dropped with its connection, whatever is buffered."""
    if ex.writing and request.transport is not None:
        request.transport.abort()  # it stopped reading: what is buffered will never drain
    return out if out is not None else web.Response(status=499)


def unverified(ex: Exchange, exc: UnverifiedError) -> UnverifiedError:
    """A stream's failed verification, logged with the engine's own words (the log's only),
    as the client hears of it."""
    logger.warning("engine stream unverified (%s): %s%s", ex.where, exc, _said(exc))
    return UnverifiedError(f"the engine stream failed verification: {exc}", detail=exc.detail)


def note_outcome(ex: Exchange, verifier: ChunkVerifier) -> None:
    """What the verifier saw of the answer, in the exchange's outcome (for settling)."""
    out = ex.outcome
    out.answered = out.answered or verifier.answered
    out.first_content_at, out.last_at = verifier.first_text_at, verifier.last_at


def _said(exc: UnverifiedError) -> str:
    return f" (the engine said: {exc.detail})" if exc.detail else ""


def answer_figures(
    ex: Exchange, dep: Deployment, verifier: ChunkVerifier, sent_at: float
) -> Figures:
    """The answer's figures (``sent_at``: when the engine was asked), as its client gets them
    (without ``cached_tokens`` where the deployment withholds it); the time to first token
    among them is noted in the exchange's outcome too, for the gateway's counts."""
    figures = chat_figures(
        dep.engine,
        engine_objects=verifier.engine_objects,
        usage=verifier.usage,
        sent_at=sent_at,
        first_text_at=verifier.first_text_at,
        last_at=verifier.last_at,
    )
    ttft = figures.get("ttft_ms")
    if ttft is not None:
        ex.outcome.ttft = ttft["value"] / 1000
    if dep.cached_tokens == "withheld":
        figures.pop("cached_tokens", None)
    return figures


async def start_stream(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    """Start the client's event stream; its head leaves with the first write, which the
    caller makes next (one ``send`` less per stream: `HeadWithFirstWrite`)."""
    out = HeadWithFirstWrite(status=200, headers={**SSE_HEADERS, **headers})
    await out.prepare(request)
    return out


async def stream_error(
    request: web.Request,
    out: web.StreamResponse | None,
    err: GatewayError,
    headers: dict[str, str],
) -> web.StreamResponse:
    """Answer ``err`` in band on a stream (started here if nothing was written yet)."""
    if out is None:
        out = await start_stream(request, headers)
    try:
        await out.write(error_event(err))
        await out.write_eof()
    except ConnectionResetError:
        pass  # the client left too; nothing more to tell it
    return out
