"""Streams relayed or folded from the engine connection's reads, without waking a task
(hot path).

A generating engine sends each chunk in its own read. Relayed by a task, every read is a
wake-up: a future resolved, the task scheduled and stepped through its awaits, a write awaited.
Once the client's stream has started, `Pump` takes each read as the lean client's connection
receives it (``Body.pump``): the read is decoded and verified by the stream's `BlockReader` and,
while the client keeps up, its chunks are written to the client's socket there and then. The
relaying task sleeps meanwhile, under the exchange's deadline, as it would in a read.

Whatever needs a task goes to it (`Body.hand_over`, which also stops reading the engine until
the task says `go_on`, so at most one read is held): chunks that find the client's socket still
holding an earlier write (the task writes them as the loop did, with aiohttp's ``write``, which
waits for the client once 64 KiB are unsent, the direct writes counted; a deadline passing then
is a hang-up), the end of the answer, and a fault. The bytes the client gets, the order of its
writes and the verdicts are those of the task's loop; only the number of wake-ups changes.

Used only where its writes are the same bytes aiohttp's would be: a chunked, uncompressed
answer (any HTTP/1.1 client) whose engine answer comes through the lean client. What it knows
of aiohttp's writer (its framing, its counts) is named in ``_aiohttp.py``, checked by the canary.

`Fold` does the same for a client that asked for no stream: each read is verified and folded
into the answer where it arrives, and the task wakes once, at the end (or at a fault).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from .. import _clock
from .._aiohttp import StreamWriter, chunk, chunk_writer
from .._engine_answer import Body
from .._errors import EngineError
from .assemble import Folding
from .blocks import BlockReader
from .exchange import Exchange

__all__ = ["Fold", "Pump", "chunk", "pump_rest", "pumpable"]


def pumpable(out: web.StreamResponse) -> bool:
    """Whether the rest of an engine's stream can be pumped into ``out``: an answer whose
    every write aiohttp would frame as one plain chunk."""
    return chunk_writer(out) is not None


async def pump_rest(
    content: Body, reader: BlockReader, ex: Exchange, out: web.StreamResponse
) -> tuple[bool, list[bytes]]:
    """Relay the rest of the engine's stream into the started ``out`` (see `pumpable`) from
    the connection's reads. Returns whether ``[DONE]`` came, and the verified events of the
    answer's end that are still to be written (with its figures, by the caller)."""
    writer = chunk_writer(out)
    assert writer is not None
    pump = Pump(content, reader, ex, writer)
    content.attach(pump)
    try:
        while True:
            if not pump.ready():
                await content.wait()
            if pump.error is not None:
                raise pump.error
            events, pump.pending = pump.pending, []
            if pump.done and reader.verifier.finished:
                return True, events  # the answer is whole: these leave with its end
            if events:
                ex.writing = True  # bounded by the idle deadline, like the engine's output
                await out.write(b"".join(events))
                ex.writing = False
            if pump.done:
                return True, []
            if content.ended():
                return False, []
            content.go_on()
    finally:
        content.detach()


class Pump:
    """Takes each read of the engine's answer (``Body.pump``); see the module's text."""

    __slots__ = (
        "_body",
        "_ex",
        "_reader",
        "_transport",
        "_writer",
        "done",
        "error",
        "pending",
    )

    def __init__(self, body: Body, reader: BlockReader, ex: Exchange, writer: StreamWriter) -> None:
        assert writer.transport is not None
        self._body = body
        self._reader = reader
        self._ex = ex
        self._writer = writer
        self._transport: asyncio.Transport = writer.transport
        self.pending: list[bytes] = []
        """Verified events for the client that the task is to write."""
        self.done = False
        """``[DONE]`` came (its events, if any, are pending)."""
        self.error: Exception | None = None
        """What the reader raised: the task raises it."""

    def ready(self) -> bool:
        """Whether the task has something to do."""
        return bool(self.pending) or self.done or self.error is not None

    def __call__(self, parts: list[bytes]) -> None:
        if self.done or self.error is not None:
            return  # read after the end, or after a fault: the task reads no further
        block = parts[0] if len(parts) == 1 else b"".join(parts)
        now = _clock.now()
        try:
            events, done = self._reader.relay(block, now)
        except Exception as exc:  # the task raises it, as its own read would
            self.error = exc
            self._body.hand_over()
            return
        if events and self._reader.verifier.first_output_at is not None:
            self._ex.output(now)
        if done:
            self.done = True
            self.pending += events
            self._body.hand_over()
        elif events:
            tr = self._transport
            if self.pending or tr.is_closing() or tr.get_write_buffer_size():
                self.pending += events  # the client has not taken the last write yet
                self._body.hand_over()
                return
            framed = chunk(events[0] if len(events) == 1 else b"".join(events))
            w = self._writer
            # aiohttp's counts, kept here (not in a call to _aiohttp): its next write drains by
            # buffer_size; the canary checks that write counts both.
            w.buffer_size += len(framed)
            w.output_size += len(framed)
            tr.write(framed)


def _nothing() -> None:
    pass


class Fold:
    """Folds an engine's stream into one answer read by read, for a client that asked for no
    stream; `read` is the whole of it. Over ``max_bytes`` of stream, the answer is refused."""

    __slots__ = ("_assembler", "_ex", "_max", "_reader", "_size", "_wake", "done", "error")

    def __init__(
        self, reader: BlockReader, ex: Exchange, assembler: Folding, max_bytes: int
    ) -> None:
        self._reader = reader
        self._ex = ex
        self._assembler = assembler
        self._max = max_bytes
        self._size = 0
        self._wake = _nothing
        self.done = False
        self.error: Exception | None = None

    async def read(self, content: Body) -> bool:
        """Fold the whole of ``content``; whether ``[DONE]`` came. Raises a fault in the
        stream, or what broke its connection."""
        self._wake = content.hand_over
        content.attach(self)
        try:
            while not (self.done or self.error is not None or content.ended()):
                await content.wait()
        finally:
            content.detach()
        if self.error is not None:
            raise self.error
        return self.done

    def __call__(self, parts: list[bytes]) -> None:
        if not (self.done or self.error is not None):
            self.take(parts[0] if len(parts) == 1 else b"".join(parts))

    def take(self, block: bytes) -> None:
        """Fold one read of the stream."""
        now = _clock.now()
        self._size += len(block)
        verifier = self._reader.verifier
        chunks = verifier.chunks
        try:
            if self._size > self._max:
                raise EngineError(
                    f"{self._ex.where}: the engine's answer is over {self._max} bytes"
                )
            done = self._reader.collect(block, now, self._assembler)
        except Exception as exc:  # the task raises it, as its own read would
            self.error = exc
            self._wake()
            return
        if verifier.chunks != chunks and verifier.first_output_at is not None:
            self._ex.output(now)
        if done:
            self.done = True
            self._wake()
