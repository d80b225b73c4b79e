"""The line between a worker and its authority: one Unix stream socket (a socketpair made by the
authority), each message an orjson array behind a four-byte big-endian length.

The first message of a turn of the event loop leaves at once; the others of that turn leave
together in one write at its end. A lone request waits for nothing, and the messages of a busy
turn batch (``bench/perf/authority_cost.py`` measured 2–3 µs of the authority's CPU a request
batched, 11 µs not). A message over `MAX_MESSAGE_BYTES` is a broken peer: the line is closed.
What each side sends is a typed message (``messages.py``): the line encodes each as it is sent
and decodes each as it arrives; one it cannot decode closes the line.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import cast

import orjson

from .._loop import running_loop
from .messages import Message, decode

__all__ = ["MAX_MESSAGE_BYTES", "Wire"]

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""The largest message either side takes (the hello carries the configuration)."""
_LEN = struct.Struct(">I")


class Wire(asyncio.Protocol):
    """One end of the line: ``on_message`` gets each message, ``on_lost`` the end."""

    def __init__(self, on_message: Callable[[Message], None], on_lost: Callable[[], None]) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._transport: asyncio.WriteTransport | None = None
        self._buf = bytearray()
        self._out: list[bytes] = []
        self._quiet = True
        """Nothing was written yet in this loop turn."""
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast("asyncio.WriteTransport", transport)  # uvloop's is its own class

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        at = 0
        n = len(buf)
        while n - at >= 4:
            (size,) = _LEN.unpack_from(buf, at)
            if size > MAX_MESSAGE_BYTES:
                self.close()
                return
            if n - at - 4 < size:
                break
            try:
                message = decode(orjson.loads(memoryview(buf)[at + 4 : at + 4 + size]))
            except ValueError:  # not JSON, or not a message: a broken peer
                self.close()
                return
            at += 4 + size
            self._on_message(message)
        del buf[:at]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            self._on_lost()

    def send(self, message: Message) -> None:
        """Send ``message``: the first of a loop turn at once (a lone request's word waits for
        nothing), the rest of that turn together in one write at its end."""
        if self.closed:
            return
        data = orjson.dumps(message.encode())
        frame = _LEN.pack(len(data)) + data
        if self._quiet:
            self._quiet = False
            running_loop().call_soon(self._flush)
            if self._transport is not None:
                self._transport.write(frame)
                return
        self._out.append(frame)

    def _flush(self) -> None:
        out, self._out = self._out, []
        self._quiet = True
        if self._transport is not None and not self.closed and out:
            self._transport.write(b"".join(out))

    def close(self) -> None:
        self._flush()
        if self._transport is not None:
            self._transport.close()
