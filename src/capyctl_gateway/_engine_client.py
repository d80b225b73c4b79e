"""A lean HTTP/1.1 client for the gateway's engine requests (hot path).

It speaks only to the engines the configuration names, and only what the gateway asks of them:
one POST with a body, an answer read as it comes, over keep-alive connections pooled per engine
(idle ones for at most `IDLE_S`, under the engines' own 5 s) and parsed by httptools (llhttp).
Guaranteed, each by a test over real sockets: a request cancelled before the answer's head
closes its connection at once (the engine's signal to stop), as does `EngineResponse.close`; at
most `HIGH_WATER` bytes of an answer are buffered, past which the socket is not read until the
caller reads; chunked and content-length answers; redirects are answers (never followed); a
connection the engine closed (its end already in the socket, even unread by the loop: an engine
that just died), ended early or marked ``Connection: close`` is never reused; connecting is
bounded by ``connect_timeout``, reading by the caller's deadline. An answer that comes on a new
connection before its request is sent (a host's ingress at its connection cap answers a
connection at once) is read as that request's answer.

A connection never established raises `EngineConnectError` (the engine never got the request);
any later failure, `EngineConnectionError`. It is the gateway's only engine client (the
configuration's ``engine_client: lean`` names it; the aiohttp fallback is gone).
"""

from __future__ import annotations

import asyncio
import select

import httptools
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from . import _clock
from ._engine_answer import (
    HIGH_WATER,
    Body,
    EngineConnectError,
    EngineConnectionError,
    EngineResponse,
    unasked_read,
    watching,
)
from ._loop import running_loop

__all__ = [
    "HIGH_WATER",
    "Body",
    "IDLE_S",
    "EngineClient",
    "EngineConnectError",
    "EngineConnectionError",
    "EngineResponse",
]

IDLE_S = 4.0
"""How long an idle engine connection stays pooled, by this client and by the gateway's aiohttp
sessions alike: under the 5 s after which llama-server and uvicorn (vLLM, SGLang) close one, so
that the gateway never sends on a connection the engine is closing at that moment (measured on
llama-server b10798: idle 5.5 s, then the next request met a closed connection)."""
MAX_IDLE_PER_ENGINE = 256
SWEEP_S = 0.5
"""How often idle connections are looked at (so none lives much past `IDLE_S`)."""


class _Connection(asyncio.Protocol):
    def __init__(self, pool: EngineClient, key: tuple[str, int]) -> None:
        self._pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.watch: select.poll | None = None  # its socket, for `unasked_read`
        self.closed = False
        self.idle_since = 0.0
        # httptools looks its callbacks up once, here: each body piece (one per event of a
        # chunked answer) goes to this list's C append, without a Python frame.
        self._arrived: list[bytes] = []
        self.on_body = self._arrived.append
        self._parser = httptools.HttpResponseParser(self)
        self._head: asyncio.Future[EngineResponse] = running_loop().create_future()
        self._asked = False  # the first answer may come before its request is sent
        self._headers: CIMultiDict[str] = CIMultiDict()
        self.body = Body(self)
        self._complete = self._keep = self._paused = False

    # -- asyncio ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.watch = watching(transport.get_extra_info("socket"))

    def data_received(self, data: bytes) -> None:
        if self._complete:  # nothing was asked: an engine that says more is not trusted
            self._broken(EngineConnectionError("the engine sent data nobody asked for"))
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken(EngineConnectionError(f"the engine's answer is not HTTP: {exc}"))
        else:
            self._hand_on()

    def _hand_on(self) -> None:  # the body pieces of one read, to the reader at once
        if self._arrived:
            self.body.feed_all(self._arrived)
            self._arrived.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self._complete and exc is None and self._until_close():
            self.on_message_complete()  # a body that ends with its connection has ended
            self._keep = False
        if not self._complete:
            self._broken(EngineConnectionError("the engine closed the connection"))

    def _until_close(self) -> bool:
        """Whether the head came and the body has no length (no Content-Length, not chunked):
        then the connection's end is the body's."""
        head = self._head
        if not head.done() or head.cancelled() or head.exception() is not None:
            return False
        h = self._headers
        chunked = "chunked" in h.get("Transfer-Encoding", "").lower()
        return "Content-Length" not in h and not chunked

    def eof_received(self) -> bool | None:
        return None  # close our side too; connection_lost decides what the end means

    # -- httptools callbacks ------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        head = self._head
        if not head.done():
            head.set_result(EngineResponse(self, status, CIMultiDictProxy(self._headers)))

    def on_message_complete(self) -> None:
        self._hand_on()
        self._complete = True
        self._keep = self._parser.should_keep_alive()
        self.body.feed_eof()

    # -- ours ---------------------------------------------------------------------------------
    def _broken(self, exc: EngineConnectionError) -> None:
        self._hand_on()  # what came before the fault is read first
        head = self._head
        if not head.done():
            head.set_exception(exc)
        self.body.fail(exc)
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def send(self, request: bytes) -> asyncio.Future[EngineResponse]:
        assert self.transport is not None
        if self._asked:  # one parser a connection: it reads answer after answer
            self._head = self._head.get_loop().create_future()  # (no `running_loop` call)
            self._headers = CIMultiDict()
            self.body = Body(self)
            self._complete = self._keep = False
        self._asked = True
        self.transport.write(request)
        return self._head

    def done(self, *, reuse: bool) -> None:
        transport = self.transport
        if transport is None or self.closed:
            return
        if reuse and self._complete and self._keep and not transport.is_closing():
            self.resume()
            self.idle_since = _clock.now()
            self._pool.put(self)
        else:
            self.closed = True
            if self._complete:
                transport.close()
            else:
                transport.abort()  # cut short: at once, whatever is still to be written

    def abandon(self) -> None:
        """Close a connection no request will use, at once: nobody waits for its answer."""
        self._head.cancel()
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class EngineClient:
    """Pooled keep-alive connections to the engines; `post` is all it does."""

    def __init__(self, *, connect_timeout: float) -> None:
        self._connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._closed = False
        self._sweeper: asyncio.TimerHandle | None = None
        self._heads: dict[tuple[int, int], tuple[URL, dict[str, str], bytes, tuple[str, int]]]
        self._heads = {}

    async def post(
        self, url: URL, *, data: bytes, headers: dict[str, str], allow_redirects: bool = False
    ) -> EngineResponse:
        """Send ``data`` to ``url``; return once the answer's head has arrived."""
        head, key = self._head(url, headers)
        conn = self._take(key) or await self._connect(key)
        waiting = conn.send(b"%s%d\r\n\r\n%s" % (head, len(data), data))
        try:
            return await waiting
        except BaseException:
            conn.done(reuse=False)  # cancelled or broken before the head: the engine stops
            raise

    def _head(self, url: URL, headers: dict[str, str]) -> tuple[bytes, tuple[str, int]]:
        """The request's head up to its length, and where it goes; kept per URL and headers
        (an instance sends the same ones every time), 64 at most."""
        known = self._heads.get((id(url), id(headers)))
        if known is not None and known[0] is url and known[1] == headers:
            return known[2], known[3]
        host, port = url.raw_host or "", url.port or 80
        fields = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        if fields.count("\n") != len(headers) or fields.count("\r") != len(headers):
            raise ValueError("a header's name or value holds a line break")  # nothing sent
        head = (
            f"POST {url.raw_path_qs} HTTP/1.1\r\nHost: {_host(host)}:{port}\r\n{fields}"
            "Content-Length: "
        ).encode("latin-1")
        if len(self._heads) >= 64:
            self._heads.clear()
        self._heads[(id(url), id(headers))] = (url, dict(headers), head, (host, port))
        return head, (host, port)

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = _clock.now()
        while idle:
            conn = idle.pop()
            transport = conn.transport
            if conn.closed or transport is None or transport.is_closing():
                continue
            if now - conn.idle_since > IDLE_S or unasked_read(conn.watch):
                conn.done(reuse=False)
                continue
            return conn
        return None

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        loop = running_loop()
        conn = _Connection(self, key)
        try:
            async with asyncio.timeout(self._connect_timeout):
                await loop.create_connection(lambda: conn, key[0], key[1])
        except BaseException as exc:
            conn.abandon()  # made just as its request was given up (a hang-up, the deadline)
            if isinstance(exc, TimeoutError):
                raise EngineConnectError(f"connecting to {key[0]}:{key[1]} timed out") from None
            if isinstance(exc, OSError):
                raise EngineConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from None
            raise
        return conn

    def put(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if self._closed or len(idle) >= MAX_IDLE_PER_ENGINE:
            conn.done(reuse=False)
            return
        idle.append(conn)
        if self._sweeper is None:
            self._sweeper = running_loop().call_later(SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle for over `IDLE_S` (every `SWEEP_S` while any is pooled)."""
        self._sweeper = None
        limit = _clock.now() - IDLE_S
        for idle in self._idle.values():
            for conn in [c for c in idle if c.idle_since < limit or c.closed]:
                idle.remove(conn)
                conn.done(reuse=False)
        if any(self._idle.values()) and not self._closed:
            self._sweeper = running_loop().call_later(SWEEP_S, self._sweep)

    async def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for idle in self._idle.values():
            for conn in idle:
                conn.done(reuse=False)
        self._idle.clear()


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # an IPv6 address, as a Host header writes it
