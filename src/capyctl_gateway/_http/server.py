"""The connection layer under the handlers: what aiohttp does before a request reaches them.

`BoundedRunner` serves an application (every listener's: inference, management, metrics, the
server's control port, a host's ingress) through a protocol that:

* answers a request that is not valid HTTP (a malformed or oversized header line, a bare CR,
  a NUL) with the documented JSON error and a request ID, and logs one short line for it,
  never the header's bytes (an ``Authorization`` line is one of them);
* closes a connection whose request head has not arrived within ``limits.header_timeout``
  (a client that trickles bytes must not hold a connection for ever), and one idle between
  requests for ``limits.keepalive_timeout`` (aiohttp's keep-alive timeout, set by the runner);
* past ``limits.max_connections``, closes the oldest connection idle between requests to take
  the new one (logged) or, with none idle, answers the new one with a 503 at once and closes it
  (logged), instead of letting the process run out of file descriptors. The close is a
  half-close: what the client sends meanwhile (its request) is read and dropped until it closes
  too, for at most `LINGER_S`, so that its request does not turn the close into a reset that
  destroys the 503 before the client reads it (a server then sees a host's busy ingress as a
  failed engine instead of offering the request elsewhere). At most ``max_connections`` linger
  at once; past that, and on TLS, the close is immediate.

`GatewayRunner` is the public listener's, with the settings its correctness depends on.
The control port's TLS handshakes, which come before all of it, are counted in ``tls.py``.

aiohttp has no public hooks for any of it: this module reaches aiohttp's internals only through
``_aiohttp.py``, never directly.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from aiohttp import web

from .._aiohttp import (
    Protocol,
    Runner,
    Server,
    answer_started,
    idle,
    no_keepalive_yet,
    recast,
    request_count,
    task_handler,
)
from .._errors import GatewayError
from .._loop import running_loop
from .._ulid import REQUEST_ID, new_ulid
from .answers import error_response
from .limits import Limits

__all__ = [
    "HANGUPS_SEEN",
    "LIMITS",
    "LINGER_S",
    "SERVER",
    "BoundedRunner",
    "BoundedServer",
    "GatewayRunner",
    "Limits",
]

logger = logging.getLogger("capyctl_gateway")
LINGER_S = 2.0
"""How long a connection refused past the cap is read (and what comes dropped) after its 503."""


LIMITS: web.AppKey[Limits] = web.AppKey("connection_limits")
HANGUPS_SEEN: web.AppKey[bool] = web.AppKey("hang_ups_seen")


def _busy_answer(extra: bytes) -> bytes:
    body = orjson.dumps(
        {
            "code": "unavailable",
            "message": "the gateway has as many connections as it takes; retry shortly",
            "retryable": True,
        }
    )
    return (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nRetry-After: 1\r\n"
        + extra
        + REQUEST_ID.encode()
        + b": "
        + new_ulid().encode()
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


class _Protocol(Protocol):
    """aiohttp's request handler, with the gateway's answers to what never became a request."""

    __slots__ = ("_head_timer", "_limits", "_heads_seen", "_leaving", "_lingering", "_server")

    def __init__(self, manager: BoundedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._server = manager
        self._limits = manager.limits
        self._head_timer: asyncio.TimerHandle | None = None
        self._heads_seen = 0
        self._lingering = False
        self._leaving = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._server.refused is transport:  # answered 503 and half-closed: read until closed
            self._server.refused = None
            self._server.lingering += 1
            self._lingering = True
            no_keepalive_yet(self)
            if (task := task_handler(self)) is not None:
                task.cancel()
            self._head_timer = running_loop().call_later(LINGER_S, transport.close)
        elif not transport.is_closing():
            self._head_timer = running_loop().call_later(self._limits.header_timeout, self._no_head)
            no_keepalive_yet(self)  # the head timeout bounds the wait for the first request
        elif (task := task_handler(self)) is not None:
            # Refused (past max_connections): its request loop must not start, for aiohttp
            # cancels it on the close only where handlers are cancelled on hang-ups.
            task.cancel()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # a refused connection's request: read, and dropped
        super().data_received(data)
        heads = request_count(self)
        if heads != self._heads_seen:  # a whole request head arrived
            self._heads_seen = heads
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

    @property
    def between_requests(self) -> bool:
        """Answered at least once and idle, waiting for its next request."""
        busy = self._heads_seen == 0 or self._head_timer is not None or self._leaving
        return not busy and idle(self)

    def leave(self) -> None:
        """Close this connection to make room for a new one (not counted from now on)."""
        self._leaving = True
        self.force_close()

    @property
    def counted(self) -> bool:
        """Counted against the cap: neither refused nor closed to make room."""
        return not (self._leaving or self._lingering)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._lingering:
            self._lingering = False
            self._server.lingering -= 1
        super().connection_lost(exc)

    def _no_head(self) -> None:
        self._head_timer = None
        if request_count(self) == self._heads_seen and self.transport is not None:
            self._limits.protocol_log.warning("connection closed: %s", self._limits.head())
            self.transport.close()

    def answer_error(
        self, request: web.BaseRequest, status: int, exc: BaseException | None
    ) -> web.StreamResponse:
        rid = new_ulid()
        if status == 400:
            # The exception's text quotes the offending bytes (an Authorization line among
            # them): only its class is logged.
            kind = type(exc).__name__ if exc is not None else "malformed request"
            self._limits.protocol_log.warning(
                "request %s: not valid HTTP (%s); answered 400", rid, kind
            )
            err = GatewayError(f"the request is not valid HTTP ({kind})", status=400)
            err.code = "invalid_request"
        else:
            logger.error("request %s: the gateway failed (%d)", rid, status, exc_info=exc)
            err = GatewayError("the gateway failed on this request; it is logged", status=status)
        if answer_started(request):
            raise ConnectionError("an answer was started already; the connection is closed")
        resp = error_response(err, {REQUEST_ID: rid, "Server": SERVER})  # no app signals here
        resp.force_close()
        return resp


class BoundedServer(Server):
    limits: Limits
    lingering: int
    """Connections refused past the cap and not closed yet (not counted against it)."""
    refused: asyncio.Transport | None
    """The connection just refused, for its protocol to linger on."""

    def make_protocol(self, **kwargs: Any) -> web.RequestHandler:
        return _Protocol(self, **kwargs)

    def connected(self, transport: asyncio.Transport, open_connections: int) -> None:
        limits = self.limits
        cap = limits.max_connections
        if open_connections - self.lingering > cap and self.held() > cap and not self.make_room():
            limits.refusal_log.warning("connection refused: %s", limits.cap())
            try:
                transport.write(_busy_answer(limits.busy_headers))
                if self.lingering < limits.max_connections and transport.can_write_eof():
                    transport.write_eof()
                    self.refused = transport
                else:
                    transport.close()
            except OSError:  # the client reset it already (ENOTCONN): nothing left to tell
                transport.close()

    def make_room(self) -> bool:
        """Close the oldest connection idle between requests, if any, for a new one (logged)."""
        for handler in self.handlers():
            if isinstance(handler, _Protocol) and handler.between_requests:
                handler.leave()
                self.limits.idle_log.warning(
                    "an idle keep-alive connection closed for a new one: %s", self.limits.cap()
                )
                return True
        return False

    def held(self) -> int:
        """The connections counted against the cap (one closed to make room may take a while
        to go, a TLS one above all, and aiohttp counts a connection until its request loop
        ends): counted one by one, so only near the cap."""
        return sum(1 for h in self.handlers() if not isinstance(h, _Protocol) or h.counted)


SERVER = "capyctl-gateway"
"""The ``Server`` header of every answer (aiohttp's names Python's and its own versions)."""


async def _neutral_server(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER


class BoundedRunner(Runner):
    """An `aiohttp.web.AppRunner` whose connections go through the connection layer above:
    at most ``limits.max_connections`` open (idle ones closed first for new ones), each closed
    when its request head does not come within ``limits.header_timeout`` or when idle between
    requests for ``limits.keepalive_timeout``, malformed HTTP answered in JSON. Every listener
    of the gateway and of a host is served by one. No access log."""

    def __init__(
        self, app: web.Application, *, limits: Limits | None = None, **kwargs: Any
    ) -> None:
        """``limits``: this listener's bounds; by default the application's (`LIMITS`)."""
        self._limits = limits if limits is not None else app[LIMITS]
        app.on_response_prepare.append(_neutral_server)
        kwargs.setdefault("access_log", None)
        kwargs["keepalive_timeout"] = self._limits.keepalive_timeout
        super().__init__(app, **kwargs)

    def adopt(self, server: web.Server) -> web.Server:
        # aiohttp builds its Server and has no hook for the protocol class: the instance is
        # made a BoundedServer, which changes only its protocol and the connection count.
        bounded = recast(server, BoundedServer)
        bounded.limits = self._limits
        bounded.lingering, bounded.refused = 0, None
        return bounded


class GatewayRunner(BoundedRunner):
    """A `BoundedRunner` with the settings the gateway's correctness depends on: handlers are
    cancelled when their client goes away; the bounds of ``limits:`` in the configuration; no
    access log (the gateway logs each request itself)."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        kwargs["handler_cancellation"] = True
        app[HANGUPS_SEEN] = True
        super().__init__(app, **kwargs)
