"""An engine's answer as the lean client hands it over: its body as it arrives, with a bound
on what is buffered, and the connection's two possible fates (`_engine_client.py`), the test of
an idle one before it is used again among them (`unasked_read`)."""

from __future__ import annotations

import asyncio
import collections
import select
import socket
from collections.abc import Callable
from typing import Protocol

from multidict import CIMultiDictProxy

from ._loop import running_loop

__all__ = [
    "HIGH_WATER",
    "Body",
    "EngineConnectError",
    "EngineConnectionError",
    "EngineResponse",
    "unasked_read",
    "watching",
]

HIGH_WATER = 256 * 1024
"""Answer bytes buffered before the socket stops being read."""


class Reading(Protocol):
    """What a body needs of its connection."""

    body: Body

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def done(self, *, reuse: bool) -> None: ...


class EngineConnectError(OSError):
    """The connection to the engine was never established: it never got the request."""


class EngineConnectionError(ConnectionError):
    """The connection failed after it was established (closed early, not HTTP)."""


class Body:
    """An answer's body as it arrives: `readany`, `read`, `is_eof` (as aiohttp's reader)."""

    __slots__ = ("_buffer", "_conn", "_eof", "_error", "_size", "_waiter", "pump")

    def __init__(self, conn: Reading) -> None:
        self._conn = conn
        self._buffer: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.pump: Callable[[list[bytes]], None] | None = None
        """Takes each read's pieces instead of the buffer while attached; it keeps none
        of them, and hands over to the reader with `hand_over`. The reader then waits with
        `wait`, not `readany`."""

    def feed_all(self, parts: list[bytes]) -> None:
        """What one read of the socket brought (the parser's body pieces, in order)."""
        if self.pump is not None:
            self.pump(parts)
            return
        self._buffer.extend(parts)
        self._size += sum(map(len, parts))
        if self._size > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def fail(self, exc: BaseException) -> None:
        if not self._eof:
            self._error = exc
            self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def attach(self, pump: Callable[[list[bytes]], None]) -> None:
        """Give each read to ``pump`` from now on, starting with what is buffered."""
        self.pump = pump
        if self._buffer:
            parts = list(self._buffer)
            self._buffer.clear()
            self._size = 0
            self._conn.resume()  # paused at HIGH_WATER, perhaps: the pump decides now
            pump(parts)

    def detach(self) -> None:
        """Back to the buffer: reads go to `readany` again (and the socket is read)."""
        self.pump = None
        self._conn.resume()

    def hand_over(self) -> None:
        """The pump has something for the reader: the socket is not read until `go_on`."""
        self._conn.pause()
        self._wake()

    def go_on(self) -> None:
        """Read the socket again (after `hand_over`)."""
        self._conn.resume()

    async def wait(self) -> None:
        """Until the pump hands over, or the body ends or fails (`ended` says which)."""
        if not self._eof and self._error is None:
            self._waiter = waiter = running_loop().create_future()
            await waiter

    def ended(self) -> bool:
        """Whether the whole body has been read; raises what broke the connection."""
        if self._error is not None:
            raise self._error
        return self.is_eof()

    def is_eof(self) -> bool:
        return self._eof and not self._buffer

    async def readany(self) -> bytes:
        """What has arrived (waiting for something); b"" at the end."""
        while not self._buffer and not self._eof:  # waited for here: a frame less each wake
            if self._error is not None:
                raise self._error
            self._waiter = running_loop().create_future()
            await self._waiter
        if not self._buffer:
            return b""
        data = self._buffer.popleft() if len(self._buffer) == 1 else b"".join(self._buffer)
        self._buffer.clear()
        self._size = 0
        self._conn.resume()
        return data

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (all of it with ``n`` < 0), waiting for some."""
        if n < 0:
            parts = []
            while chunk := await self.readany():
                parts.append(chunk)
            return b"".join(parts)
        data = await self.readany()
        if len(data) > n:
            self._buffer.appendleft(data[n:])
            self._size = len(data) - n
            data = data[:n]
        return data


class EngineResponse:
    """An engine's answer: its status and headers, its body as it comes."""

    __slots__ = ("_conn", "content", "headers", "status")

    def __init__(self, conn: Reading, status: int, headers: CIMultiDictProxy[str]) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers
        self.content = conn.body

    def release(self) -> None:
        """Pool the connection if the answer ended whole and the engine keeps it open."""
        self._conn.done(reuse=True)

    def close(self) -> None:
        """Close the connection (an engine reads that as the end of the request)."""
        self._conn.done(reuse=False)


def watching(sock: socket.socket | None) -> select.poll | None:
    """What `unasked_read` asks of a connection's socket ``sock``: a poll of it, registered
    once, as the connection is made (None without a socket)."""
    if sock is None:
        return None
    watch = select.poll()
    watch.register(sock.fileno(), select.POLLIN)
    return watch


def unasked_read(watch: select.poll | None) -> bool:
    """Whether an idle connection's socket (``watch``: `watching` it) has something to read:
    its engine closed it (an engine that just died, its end not yet read by the loop) or sent
    what nobody asked for. Either way no request may go on it: one that did would be lost to an
    engine that provably never got it. One poll that does not wait (about 0.3 us: registered
    once, not at every request)."""
    return watch is not None and bool(watch.poll(0))
