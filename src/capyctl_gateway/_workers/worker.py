"""One worker: the public listener's application over a `RemoteDesk`, with its own engine
client, serving one share of the public port.

It learns everything from its authority's ``HELLO`` (the configuration, the key, its share
of the listener's bounds), serves until ``QUIT`` (``STOP`` first stops it listening), and ends
when its line does. The process around it is ``_cli_workers.py``; a test can run several in
one process (the line is any connected Unix socket).
"""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web

from .._config import GatewayConfig
from .._config.bounds import Limits, shared_bounds
from .._engine_client import EngineClient
from .._gateway import Gateway
from .._http.app import public_app
from .._http.inference import Inference
from .._http.server import GatewayRunner
from .._loop import running_loop
from .desk import RemoteDesk
from .messages import Abort, Hello, Message, Offer, Ping, Pong, Quit, Ready, Refused, Stop
from .wire import Wire

__all__ = ["END_GRACE_S", "Worker", "bound", "share"]

END_GRACE_S = 5.0
"""After ``QUIT``, how long the requests still open get to write their last words."""
BACKLOG = 4096


def share(total: int, workers: int) -> int:
    """One worker's part of a bound the whole gateway has (a field marked `SHARED`:
    ``limits.max_connections``, ``limits.max_body_bytes_in_flight``): rounded up, so that the
    parts add up to at least it."""
    return math.ceil(total / workers)


class Worker:
    """A worker: `connect` to the authority, `serve` a listening socket until told to stop."""

    def __init__(self) -> None:
        self.wire = Wire(self._message, self._lost)
        self.orders: asyncio.Queue[Hello | Stop | Quit] = asyncio.Queue()
        """The authority's orders for the worker itself: hello, stop, quit (and a quit of its
        own when the line ends)."""
        self.desk: RemoteDesk | None = None
        self.config: GatewayConfig | None = None
        self.key = ""
        self.started_at = 0
        self._runner: GatewayRunner | None = None

    def _message(self, m: Message) -> None:
        desk = self.desk
        if isinstance(m, Offer | Refused):
            if desk is not None:
                desk.answer(m)
        elif isinstance(m, Abort):
            if desk is not None:
                desk.abort(m.gid, m.why, m.code)
        elif isinstance(m, Ping):
            self.wire.send(Pong(m.n))  # alive
            if desk is not None:
                desk.heard_at = running_loop().time()
        elif isinstance(m, Hello | Stop | Quit):
            self.orders.put_nowait(m)

    def _lost(self) -> None:
        if self.desk is not None:
            self.desk.lost()
        self.orders.put_nowait(Quit())

    async def connect(self, line: socket.socket) -> dict[str, Any]:
        """Open the line and wait for the authority's hello; returns it."""
        await running_loop().create_unix_connection(lambda: self.wire, sock=line)
        first = await self.orders.get()
        if not isinstance(first, Hello):
            raise ConnectionError("the authority ended before its hello")
        hello = first.doc
        workers = hello["workers"]
        config = GatewayConfig.model_validate(hello["config"])
        limits = config.limits.model_copy(
            update={
                name: share(getattr(config.limits, name), workers) for name in shared_bounds(Limits)
            }
        )
        self.config = config.model_copy(update={"limits": limits})
        self.key = hello["key"]
        self.started_at = int(hello["started_at"])
        self.prefix_seed = int(hello["prefix_seed"])
        engines = EngineClient(connect_timeout=config.queue.connect_timeout)
        self.desk = RemoteDesk(self.config, engines, self.wire)
        if hello.get("pinged"):  # its silence from now on is its authority's (FROZEN_S)
            self.desk.heard_at = running_loop().time()
        return hello

    async def serve(self, sock: socket.socket, on_ready: Callable[[], None] | None = None) -> None:
        """Serve the public application on ``sock`` (bound, not yet listening) until the
        authority says ``QUIT`` or its line ends; then the requests still open get
        `END_GRACE_S` to finish."""
        desk, config = self.desk, self.config
        assert desk is not None and config is not None
        gateway = Gateway(
            config, self.key, started_at=self.started_at, prefix_seed=self.prefix_seed
        )
        runner = self._runner = GatewayRunner(
            public_app(gateway, Inference(gateway, desk)), shutdown_timeout=END_GRACE_S
        )
        await runner.setup()
        site = web.SockSite(runner, sock, backlog=BACKLOG)
        await site.start()
        self.wire.send(Ready())
        if on_ready is not None:
            on_ready()
        while True:
            order = await self.orders.get()
            if isinstance(order, Stop):
                for each in list(runner.sites):
                    await each.stop()
            elif isinstance(order, Quit):
                break

    async def close(self) -> None:
        """Close the listener (its open requests get `END_GRACE_S`), the engine connections
        and the line."""
        if self._runner is not None:
            await self._runner.cleanup()
        desk = self.desk
        if desk is not None:
            for task in list(desk.drains):
                task.cancel()
            await asyncio.gather(*desk.drains, return_exceptions=True)
            await desk.engines.close()
        self.wire.close()


def bound(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A socket bound to ``host:port`` (``SO_REUSEADDR``); ``reuse_port``: with
    ``SO_REUSEPORT`` too, so that each worker binds the port and the kernel spreads new
    connections over those listening. Raises `OSError`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
