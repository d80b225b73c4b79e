"""aiohttp's private and undocumented names: the one module of the gateway that touches them.

aiohttp has no public API for some of what the gateway does. Each name relied on is listed here
with the reason, and ``tests/gateway/test_aiohttp_canary.py`` checks, on a real server over a
real socket, that it still has the shape relied on. ``pyproject.toml`` bounds aiohttp below the
first minor that the canary has not passed on.

The connection layer (``_http/server.py``: the connection cap, the head timeout, the JSON
answer to malformed HTTP):

* ``web.RequestHandler`` (``aiohttp.web_protocol``) is subclassed (`Protocol`): its
  ``__init__(manager, *, loop, **kwargs)``, its ``__slots__``, and its ``handle_error(request,
  status, exc, message)`` hook, through which aiohttp answers what never became a request
  (`Protocol.answer_error`).
* ``RequestHandler._request_count``, the request heads parsed on the connection
  (`request_count`): the head timeout stops once it moves.
* ``RequestHandler._task_handler``, the connection's request loop, set by ``connection_made``
  (`task_handler`): cancelled for a connection refused past the cap.
* ``RequestHandler._waiter`` (the future its request loop awaits for the next request) and
  ``._messages`` (the requests parsed and not yet handled): idle between requests while the one
  is pending and the other empty (`idle`), which is when aiohttp's own keep-alive timeout closes
  it too; such a connection is closed (``force_close()``) to take a new one past the cap.
* ``RequestHandler._keepalive_handle``, the keep-alive timer, which aiohttp 3.14 also starts
  when a connection opens (`no_keepalive_yet`): the head timeout bounds that phase instead.
* ``web.Server._loop`` and ``._kwargs``, what ``Server.__call__`` makes a handler with
  (`Server.make_protocol`), and ``Server._connections``, the open connections (their handlers,
  oldest first: `Server.handlers`), the new one counted when ``Server.connection_made(handler,
  transport)`` is called (`Server.connected`).
* ``web.AppRunner._make_server()``, which builds a plain ``web.Server``: aiohttp has no hook for
  the protocol class, so the instance is made a `Server` by ``server.__class__ = ...``
  (`Runner.adopt`, `recast`).
* ``web.BaseRequest.writer`` and its ``output_size`` (`answer_started`).

Dispatch (every listener's requests, `PlainRoutes`):

* ``web.Server.request_handler``, what each connection's handler calls with a request (the
  application's ``_handle`` as ``AppRunner`` builds it): `Runner` wraps it.
* ``web.Request._match_info``, the match info ``Application._handle`` sets and
  ``Request.match_info``, ``.app`` and the response's prepare hook (its ``on_response_prepare``
  signal) read: `PlainRoutes` sets the one it kept.

The relay (``_relay/pump.py``, ``_relay/chat.py``: chunk framing, back-pressure, one send):

* ``StreamResponse._payload_writer``, and its ``StreamWriter``'s (``aiohttp.http_writer``)
  ``chunked``, ``_compress`` and ``transport``: whether each write is framed as one plain chunk,
  as `chunk` frames it (`chunk_writer`).
* ``StreamWriter.buffer_size`` and ``output_size``: the pump writes to the client's socket
  itself and adds its bytes to both, as ``StreamWriter.write`` does, so that aiohttp's next
  ``write`` drains once more than its ``LIMIT`` (64 KiB) is unsent. The pump adds them in its
  per-read path itself (``Pump.__call__``), on the writer it got from `chunk_writer`: a function
  here would be one more Python call per relayed chunk, so this module names them and the
  canary checks them instead.
* ``StreamResponse._send_headers_immediately`` (aiohttp 3.12 and later): False on
  `HeadWithFirstWrite`, whose head leaves with its first write, as ``web.Response``'s does.

Checked against aiohttp 3.12.0, 3.12.15, 3.13.0, 3.13.5, 3.14.0 and 3.14.5: the canary passes on
each, the cancel and pump suites on 3.12.0 and 3.14.0, the gateway's whole suite on 3.14.5. On
3.10 and 3.11 every name but ``_send_headers_immediately`` has its shape (heads leave alone
there), hence ``aiohttp>=3.12,<3.15`` in ``pyproject.toml``. The dispatch's two names were
checked on 3.12.0 and 3.14.5 (``tests/gateway/http/test_plain_routes.py`` passes on both).

Never imports a module of the gateway: only asyncio and aiohttp.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from aiohttp import hdrs, web
from aiohttp.http_writer import StreamWriter

__all__ = [
    "HeadWithFirstWrite",
    "PlainRoutes",
    "Protocol",
    "Runner",
    "Server",
    "StreamWriter",
    "answer_started",
    "chunk",
    "chunk_writer",
    "idle",
    "no_keepalive_yet",
    "recast",
    "request_count",
    "task_handler",
]

S = TypeVar("S", bound="Server")


# -- the connection layer -------------------------------------------------------------------------
class Protocol(web.RequestHandler):
    """aiohttp's request handler (one per connection), whose answer to a request that failed
    before reaching a handler (not valid HTTP, or a handler's crash) is `answer_error`."""

    __slots__ = ()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        return self.answer_error(request, status, exc)

    def answer_error(
        self, request: web.BaseRequest, status: int, exc: BaseException | None
    ) -> web.StreamResponse:
        """The answer to ``request``, which failed with ``status`` (400: not valid HTTP) and
        ``exc``; aiohttp's unless overridden. Raising closes the connection."""
        return super().handle_error(request, status, exc)


def request_count(proto: web.RequestHandler) -> int:
    """The request heads parsed so far on ``proto``'s connection (a malformed one too)."""
    return proto._request_count


def task_handler(proto: web.RequestHandler) -> asyncio.Task[None] | None:
    """``proto``'s request loop: the task started by ``connection_made``, None once lost."""
    return proto._task_handler


def idle(proto: web.RequestHandler) -> bool:
    """Whether ``proto``'s request loop waits for a request, none parsed and unhandled."""
    waiter = proto._waiter
    return waiter is not None and not waiter.done() and not proto._messages


def no_keepalive_yet(proto: web.RequestHandler) -> None:
    """Stop the keep-alive timer aiohttp starts when a connection opens (it starts again once
    an answer is done)."""
    handle = proto._keepalive_handle
    if handle is not None:
        handle.cancel()
        proto._keepalive_handle = None


class Server(web.Server):
    """aiohttp's low-level server as `Runner` serves it: its handlers are `make_protocol`'s, and
    `connected` hears of each connection with the number open. Keeps no state of its own."""

    def __call__(self) -> web.RequestHandler:
        return self.make_protocol(loop=self._loop, **self._kwargs)

    def connection_made(self, handler: web.RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self.connected(transport, len(self._connections))

    def handlers(self) -> Iterator[web.RequestHandler]:
        """The handlers of the open connections, oldest first."""
        return iter(self._connections)

    def make_protocol(self, **kwargs: Any) -> web.RequestHandler:
        """The handler of a new connection; ``kwargs`` are the runner's handler settings."""
        return web.RequestHandler(self, **kwargs)

    def connected(self, transport: asyncio.Transport, open_connections: int) -> None:
        """``transport`` connected: ``open_connections`` are open, this one among them."""


class Runner(web.AppRunner):
    """An `aiohttp.web.AppRunner` whose server is `adopt`'s, its requests dispatched by
    `PlainRoutes`."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.request_handler = PlainRoutes(self.app, server.request_handler)
        return self.adopt(server)

    def adopt(self, server: web.Server) -> web.Server:
        """The server to serve with, given the plain one aiohttp built (see `recast`)."""
        return server


_Handle = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class PlainRoutes:
    """A server's request handler: a request for a route with no variable part goes straight
    to its handler, with the match info aiohttp made for the first request of its method and
    path; any other request through the application as before (``handle``: its router, and
    its answer to ``Expect: 100-continue``).

    aiohttp resolves every request afresh: an ``asyncio.get_event_loop()`` (a ``getpid`` system
    call on Python 3.11), a walk of the router's index, a match info made, the application added
    to it and frozen. For a plain route all of that comes out the same for each request of that
    method and path (its resource matches the path by string equality), so the frozen match
    info is kept and shared: at most one a (route, method), the routes being the bound. Nothing
    of the gateway writes into a match info, whose mapping is empty for a plain route. An
    application with middlewares or sub-applications, which may change a request's match info,
    goes through aiohttp every time."""

    __slots__ = ("_handle", "_kept", "_keeps")

    def __init__(self, app: web.Application, handle: _Handle) -> None:
        self._handle = handle
        self._kept: dict[tuple[str, str], web.UrlMappingMatchInfo] = {}
        self._keeps = not app.middlewares and not any(
            isinstance(r, web.PrefixedSubAppResource) for r in app.router.resources()
        )

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        kept = self._kept.get((request.method, request.rel_url.path_safe))
        if kept is None or hdrs.EXPECT in request.headers:
            try:
                return await self._handle(request)
            finally:
                self._keep(request)
        assert isinstance(request, web.Request)  # an application's requests are
        request._match_info = kept
        return await kept.handler(request)

    def _keep(self, request: web.BaseRequest) -> None:
        info = getattr(request, "_match_info", None)
        if (
            self._keeps
            and type(info) is web.UrlMappingMatchInfo  # not an error's (MatchInfoError)
            and isinstance(info.route.resource, web.PlainResource)
            and info.route.method == request.method  # not a route for any method
        ):
            self._kept[(request.method, request.rel_url.path_safe)] = info


def recast(server: web.Server, cls: type[S]) -> S:
    """``server`` made a ``cls``: the protocol it makes and what it does on a connection change,
    nothing else (a `Server` keeps no state of its own)."""
    server.__class__ = cls
    assert isinstance(server, cls)
    return server


def answer_started(request: web.BaseRequest) -> bool:
    """Whether bytes of an answer to ``request`` were written to its connection."""
    return request.writer.output_size > 0


# -- the relay ----------------------------------------------------------------------------------
class HeadWithFirstWrite(web.StreamResponse):
    """A stream whose head leaves with its first write, in one ``send`` (a whole short answer is
    then a single write). aiohttp's ``web.Response`` does the same; a StreamResponse opts in
    with this attribute (should aiohttp drop it, heads go alone)."""

    _send_headers_immediately = False


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked HTTP/1.1 body, framed as aiohttp frames it."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def chunk_writer(out: web.StreamResponse) -> StreamWriter | None:
    """The writer of the started ``out`` if its every write is framed as one plain `chunk`
    (aiohttp's HTTP/1.1 writer, chunked, uncompressed, connected); else None."""
    writer = out._payload_writer
    if (
        type(writer) is StreamWriter
        and writer.chunked
        and writer._compress is None
        and writer.transport is not None
    ):
        return writer
    return None
