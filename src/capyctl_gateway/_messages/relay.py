"""A Message from the engine's verified chat stream: written event by event to a client that
asked for a stream, or whole.

The engine is asked for a chat stream, as for chat, through one `Exchange` (so hang-ups,
deadlines, the idle timeout and settlement are chat's). Each read is verified and folded by the
stream's `BlockReader` into a `MessageBuilder`; the events it made leave in one write. Nothing
is written before the engine's first verified chunk: until then a fault is an HTTP error in
Anthropic's shape (a chunk that fails verification excepted, as on chat: it is told in band).
Once the stream has started a fault ends it with Anthropic's ``error`` event, after the last
whole event, never a shortened answer that looks whole. While the engine is quiet, a ``ping``
event leaves every quarter of the stream idle timeout (`Pings`); pings never keep a stream
alive past that timeout, which only the engine's output does.
"""

from __future__ import annotations

import asyncio
import contextlib

import orjson
from aiohttp import web

from .._clock import stamp
from .._config import Deployment
from .._errors import ClientGoneError, GatewayError, NotAcceptedError, UnverifiedError
from .._loop import running_loop
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
from .._relay.figures import Figures
from .._ulid import REQUEST_ID
from .build import MessageBuilder, usage_of
from .errors import error_event
from .request import Asked

__all__ = ["PING", "Pings", "collect_message", "refuse_message", "relay_message"]

PING = b'event: ping\ndata: {"type":"ping"}\n\n'


class Pings:
    """The writer of one stream: the relay's writes, and a ``ping`` whenever nothing was
    written for ``every`` seconds (a task of its own, ended with the stream)."""

    __slots__ = ("_ex", "_out", "_task", "every", "last")

    def __init__(self, out: web.StreamResponse, ex: Exchange, every: float) -> None:
        self._out, self._ex, self.every = out, ex, every
        self.last = stamp()
        self._task = running_loop().create_task(self._ping())

    async def write(self, data: bytes) -> None:
        self._ex.writing = True  # bounded by the idle deadline, like the engine's output
        await self._out.write(data)
        self._ex.writing = False
        self.last = stamp()

    async def _ping(self) -> None:
        while True:
            await asyncio.sleep(max(0.0, self.last + self.every - stamp()))
            if stamp() - self.last >= self.every and not self._ex.writing:
                await self.write(PING)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionResetError):
            await self._task


def _builder(dep: Deployment, asked: Asked, cap: int, *, streaming: bool) -> MessageBuilder:
    return MessageBuilder(asked, model=dep.name, max_bytes=cap, streaming=streaming)


async def relay_message(
    request: web.Request,
    ex: Exchange,
    dep: Deployment,
    payload: bytes,
    *,
    headers: dict[str, str],
    asked: Asked,
    cap: int,
) -> web.StreamResponse:
    """Relay the engine's stream to a streaming client as the Messages API's events."""
    reader = stream_reader(dep)
    verifier = reader.verifier
    builder = _builder(dep, asked, cap, streaming=True)
    out: web.StreamResponse | None = None
    pings: Pings | None = None
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
                    pings = Pings(out, ex, ex.idle_timeout / 4)
                if pings is not None and not done and (events := builder.take()):
                    await pings.write(events)
            verifier.verify_end(done)
            ex.complete()
            figures = answer_figures(ex, dep, verifier, sent_at)
            builder.finished(usage_of(verifier.usage, figures))
            if out is None:
                out = await start_stream(request, headers)
            if pings is not None:
                await pings.stop()
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
        if pings is not None:
            await pings.stop()
        note_outcome(ex, verifier)


async def collect_message(
    ex: Exchange, dep: Deployment, payload: bytes, *, asked: Asked, cap: int
) -> tuple[bytes, Figures]:
    """The whole Message for a client that asked for no stream: its JSON bytes, and the
    figures (which its surface sends in a header: a Message has no room for them)."""
    builder = _builder(dep, asked, cap, streaming=False)
    verifier, sent_at = await fold(ex, dep, payload, builder, cap)
    figures = answer_figures(ex, dep, verifier, sent_at)
    message = builder.finished(usage_of(verifier.usage, figures))
    return orjson.dumps(message), figures


async def refuse_message(
    request: web.Request, err: GatewayError, headers: dict[str, str]
) -> web.StreamResponse:
    """A refusal of a request that asked for a stream (``cache_salt`` where the engine ignores
    it), told as a Messages stream tells a failure: one ``error`` event."""
    out = await start_stream(request, headers)
    with contextlib.suppress(ConnectionResetError):
        await out.write_eof(error_event(err, headers.get(REQUEST_ID)))
    return out


async def _fail(
    request: web.Request,
    out: web.StreamResponse | None,
    builder: MessageBuilder,
    err: GatewayError,
    headers: dict[str, str],
) -> web.StreamResponse:
    builder.discard()  # what the failing read made is not sent
    if out is None:
        out = await start_stream(request, headers)
        last = builder.take()  # message_start and ping: the stream begins as a Message's
    else:
        last = b""
    with contextlib.suppress(ConnectionResetError):  # the client left too
        await out.write_eof(last + error_event(err, headers.get(REQUEST_ID)))
    return out
