"""A Response from the engine's verified chat stream: written event by event to a client that
asked for a stream, or whole.

The engine is asked for a chat stream, as for chat, through one `Exchange` (so hang-ups,
deadlines, the idle timeout and settlement are chat's). Each read is verified and folded by the
stream's `BlockReader` into a `ResponseBuilder`; the events it made leave in one write. Nothing
is written before the engine's first verified chunk: until then a fault is an HTTP error, as on
chat (a chunk that fails verification excepted, also as on chat: it is told in band). Once the
stream has started a fault ends it with ``response.failed``, whose message is
ours (``code: message``), never a shortened answer that looks whole; its ``error.code`` is
OpenAI's ``server_error``, the one its schema has for a fault that is not the client's.
"""

from __future__ import annotations

import contextlib
import time

import orjson
from aiohttp import web

from .._clock import stamp
from .._config import Deployment
from .._errors import (
    ClientGoneError,
    GatewayError,
    NotAcceptedError,
    UnverifiedError,
)
from .._relay.chat import (
    answer_figures,
    client_gone,
    fold,
    note_outcome,
    start_stream,
    stream_reader,
    unverified,
)
from .._relay.exchange import Exchange
from .build import ResponseBuilder
from .request import Echo
from .usage import usage_of

__all__ = ["collect_response", "refuse_response", "relay_response"]


def _builder(dep: Deployment, echo: Echo, cap: int, *, streaming: bool) -> ResponseBuilder:
    return ResponseBuilder(
        echo, model=dep.name, created_at=int(time.time()), max_bytes=cap, streaming=streaming
    )


async def relay_response(
    request: web.Request,
    ex: Exchange,
    dep: Deployment,
    payload: bytes,
    *,
    headers: dict[str, str],
    echo: Echo,
    cap: int,
) -> web.StreamResponse:
    """Relay the engine's stream to a streaming client as the Responses API's events."""
    reader = stream_reader(dep)
    verifier = reader.verifier
    builder = _builder(dep, echo, cap, streaming=True)
    out: web.StreamResponse | None = None
    sent_at = stamp()
    try:
        async with ex:
            content = await ex.open_stream(payload)
            done = False
            while not done and (block := await content.readany()):
                now = stamp()
                chunks = verifier.chunks
                done = reader.collect(block, now, builder)
                if verifier.chunks != chunks and verifier.first_output_at is not None:
                    ex.output(now)  # only output keeps a stream alive, not pings
                if out is None and verifier.chunks:
                    out = await start_stream(request, headers)
                if out is not None and not done and (events := builder.take()):
                    ex.writing = True  # bounded by the idle deadline, like the engine's output
                    await out.write(events)
                    ex.writing = False
            verifier.verify_end(done)
            ex.complete()
            figures = answer_figures(ex, dep, verifier, sent_at)
            if out is None:
                out = await start_stream(request, headers)
            builder.finished(usage_of(verifier.usage, figures, reasoned=builder.reasoned))
            last = builder.take() + b": x-capyctl-metrics " + orjson.dumps(figures) + b"\n\n"
            ex.writing = True
            await out.write_eof(last)
            ex.writing = False
        return out
    except (ClientGoneError, ConnectionResetError):
        return client_gone(request, ex, out)
    except NotAcceptedError:
        raise
    except UnverifiedError as exc:  # in band even before anything was written, as on chat
        return await _fail(request, out, builder, unverified(ex, exc), headers)
    except GatewayError as err:
        if out is None:
            raise  # nothing written yet: the HTTP surface answers it
        return await _fail(request, out, builder, err, headers)
    finally:
        note_outcome(ex, verifier)


async def collect_response(
    ex: Exchange, dep: Deployment, payload: bytes, *, echo: Echo, cap: int
) -> bytes:
    """The whole Response for a client that asked for no stream; its JSON bytes."""
    builder = _builder(dep, echo, cap, streaming=False)
    verifier, sent_at = await fold(ex, dep, payload, builder, cap)
    figures = answer_figures(ex, dep, verifier, sent_at)
    response = builder.finished(usage_of(verifier.usage, figures, reasoned=builder.reasoned))
    response["capyctl"] = {"metrics": figures}
    return orjson.dumps(response)


async def refuse_response(
    request: web.Request,
    err: GatewayError,
    headers: dict[str, str],
    *,
    dep: Deployment,
    echo: Echo,
) -> web.StreamResponse:
    """A refusal of a request that asked for a stream (``cache_salt`` where the engine ignores
    it), told as a Responses stream tells a failure: the Response created and in progress,
    the ``error`` event with our code, and ``response.failed``. No engine was asked: no
    figures follow."""
    return await _fail(request, None, _builder(dep, echo, 0, streaming=True), err, headers)


async def _fail(
    request: web.Request,
    out: web.StreamResponse | None,
    builder: ResponseBuilder,
    err: GatewayError,
    headers: dict[str, str],
) -> web.StreamResponse:
    builder.discard()  # what the failing read made is not sent, nor kept in the Response
    if out is None:
        out = await start_stream(request, headers)
    builder.failed(err.code, err.message)
    with contextlib.suppress(ConnectionResetError):  # the client left too
        await out.write_eof(builder.take())
    return out
