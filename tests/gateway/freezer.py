"""A TCP proxy whose traffic can be frozen: bytes stop moving both ways while every connection
stays open, as when a network link goes down under established connections (nothing is reset,
nothing is closed). Fault injection for the several-machines tests."""

from __future__ import annotations

import asyncio
import contextlib


class Freezer:
    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def __aenter__(self) -> Freezer:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        for w in list(self._writers):
            w.close()
        await self._server.wait_closed()

    def freeze(self) -> None:
        self._flowing.clear()

    def thaw(self) -> None:
        """The link is back: what the connections still hold moves again."""
        self._flowing.set()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback, run as the connection is accepted: the writer is owned (and closed
        # on exit) even when the task that connects upstream never gets to run.
        self._writers.add(writer)
        task = asyncio.get_running_loop().create_task(self._connect(reader, writer))
        self._pipes.add(task)
        task.add_done_callback(self._pipes.discard)

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        self._writers.add(up_writer)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.get_running_loop().create_task(self._pipe(src, dst))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                await self._flowing.wait()
                data = await src.read(65536)
                await self._flowing.wait()  # frozen while reading: the bytes go nowhere
                if not data:
                    dst.write_eof()
                    return
                dst.write(data)
                await dst.drain()
