"""The server's control port on TLS, its handshakes counted against its connection cap.

A TLS handshake holds a connection, and an open file, before any HTTP is spoken, and a port
served by ``loop.create_server(ssl=...)`` counts it nowhere: 7,000 idle TCP connects used up a
server's open files, and nothing was logged. `TLSSite` accepts the control port's connections
itself instead:

* a connection that comes while the listener holds ``max_connections`` (those in their TLS
  handshake and those past it, together) takes the place of the oldest one idle between
  requests or, with none idle, is closed at once, before any TLS, and a line says so (at most
  one a second, counting the rest);
* an accept that fails because the process is out of open files (EMFILE, ENFILE) is logged the
  same way, and accepting resumes `ACCEPT_RETRY_S` later (as asyncio's own server does; uvloop's
  drops such connections without a word);
* an admitted connection has ``handshake_timeout`` to finish its handshake
  (``loop.connect_accepted_socket``, public in asyncio and uvloop) and is then the runner's
  aiohttp server's, which counts it among its open connections from then on.

Only public aiohttp names: a `web.BaseSite` subclass, and the runner's server as the protocol
factory it is documented to be.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import ssl

from aiohttp import web

from .._log import SparseLog
from .server import BoundedServer

__all__ = ["ACCEPT_RETRY_S", "TLSSite"]

ACCEPT_RETRY_S = 1.0
"""How long accepting pauses after the process ran out of open files (asyncio's own delay)."""

_OUT_OF_FILES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class TLSSite(web.BaseSite):
    """``sock`` served on TLS (``ssl_context``) to the connection layer of ``runner``, a
    `BoundedRunner`: at most its ``max_connections`` at once, handshakes included, each
    handshake done within ``handshake_timeout`` seconds (asyncio's own bound is 60 s)."""

    def __init__(
        self,
        runner: web.BaseRunner,
        sock: socket.socket,
        *,
        ssl_context: ssl.SSLContext,
        handshake_timeout: float,
        backlog: int = 128,
    ) -> None:
        super().__init__(runner)
        server = runner.server
        if not isinstance(server, BoundedServer):
            raise TypeError("a TLSSite serves a BoundedRunner's application")
        self._bounded = server
        self._listening = sock
        self._tls = ssl_context
        self._handshake_timeout = handshake_timeout
        self._queue = backlog
        self._handshakes: set[asyncio.Task[None]] = set()
        self._acceptor: asyncio.Task[None] | None = None
        self.files_log = SparseLog()

    @property
    def name(self) -> str:
        host, port = self._listening.getsockname()[:2]
        return f"https://{host}:{port}"

    @property
    def port(self) -> int:
        return int(self._listening.getsockname()[1])

    @property
    def handshaking(self) -> int:
        """Connections accepted and still in their TLS handshake."""
        return len(self._handshakes)

    async def start(self) -> None:
        await super().start()  # registered with the runner, which stops it on cleanup
        self._listening.setblocking(False)
        self._listening.listen(self._queue)
        self._acceptor = asyncio.get_running_loop().create_task(self._accept())

    async def stop(self) -> None:
        tasks = [*self._handshakes, *([self._acceptor] if self._acceptor is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._acceptor = None
        self._listening.close()
        await super().stop()

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        limits = self._bounded.limits
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listening)
            except ConnectionAbortedError:  # the client left before it was accepted
                continue
            except OSError as exc:
                why = (
                    " (the process's open-file limit: ulimit -n)"
                    if exc.errno in _OUT_OF_FILES
                    else ""
                )
                self.files_log.warning(
                    "the %s cannot accept connections: %s%s; trying again in %g s",
                    limits.listener,
                    exc.strerror,
                    why,
                    ACCEPT_RETRY_S,
                )
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            cap, server = limits.max_connections, self._bounded
            full = self.handshaking + len(server.connections) >= cap  # cheap, then exact
            if full and self.handshaking + server.held() >= cap and not server.make_room():
                conn.close()
                limits.refusal_log.warning(
                    "connection closed as it came: %s (%d of them in their TLS handshake)",
                    limits.cap(),
                    self.handshaking,
                )
                continue
            task = loop.create_task(self._handshake(conn))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        # A failed or timed-out handshake closes the connection (asyncio and uvloop alike).
        with contextlib.suppress(OSError):
            await loop.connect_accepted_socket(
                self._bounded,
                conn,
                ssl=self._tls,
                ssl_handshake_timeout=self._handshake_timeout,
            )
