"""The canary for aiohttp's private names (``capyctl_gateway/_aiohttp.py``), over real sockets.

Each check names the private name and the gateway behaviour that breaks without it. A failure
here on a new aiohttp means: mend ``_aiohttp.py`` before raising aiohttp's bound in
``pyproject.toml``. The last test holds the seam: no other module of the gateway touches them.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web
from aiohttp.http_writer import StreamWriter

from capyctl_gateway import _aiohttp as aio

pytestmark = pytest.mark.anyio
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SRC = Path(__file__).resolve().parents[2] / "src" / "capyctl_gateway"


def breaks(name: str, behaviour: str) -> str:
    return (
        f"aiohttp {aiohttp.__version__}: {name} does not have the shape capyctl_gateway/_aiohttp.py "
        f"relies on; {behaviour}. Mend _aiohttp.py before raising aiohttp's bound."
    )


CAP = "the connection cap (limits.max_connections) breaks"
HEAD = "the head timeout (limits.header_timeout) breaks"
IDLE = (
    "idle keep-alive connections are not closed for new ones at the cap, or the keep-alive "
    "timeout (limits.keepalive_timeout) cuts the wait for a first request short"
)
MALFORMED = "malformed HTTP gets aiohttp's own answer, not the gateway's JSON error and request ID"
FRAMING = "the pump's chunk framing breaks (the client gets bytes aiohttp would not send)"
DRAIN = (
    "the pump's writes escape aiohttp's back-pressure: a client that stops reading is never "
    "waited for, so its buffer grows without bound and no hang-up is seen at the idle timeout"
)


# -- a server made of the seam's classes, recording what it sees -----------------------------------
class Seen:
    def __init__(self) -> None:
        self.server_type: type | None = None
        self.kwargs: dict[str, Any] = {}
        self.connected: list[int] = []
        self.protocols: list[web.RequestHandler] = []
        self.tasks: list[tuple[object, bool]] = []
        self.reads: list[tuple[int, int]] = []
        self.errors: list[tuple[int, bool]] = []
        self.idle: list[bool] = []
        """`aio.idle` on each read, before aiohttp saw it, and in each handler."""
        self.changed = asyncio.Event()

    async def until(self, happened: Callable[[], object]) -> None:
        with anyio.fail_after(5):
            while not happened():
                self.changed.clear()
                await self.changed.wait()


class _Protocol(aio.Protocol):
    __slots__ = ("_seen",)

    def __init__(self, manager: _Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._seen = manager.seen

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._seen.protocols.append(self)
        task = aio.task_handler(self)
        self._seen.tasks.append((task, isinstance(task, asyncio.Task) and task.done()))
        self._seen.changed.set()

    def data_received(self, data: bytes) -> None:
        self._seen.idle.append(aio.idle(self))
        before = aio.request_count(self)
        super().data_received(data)
        self._seen.reads.append((before, aio.request_count(self)))
        self._seen.changed.set()

    def answer_error(
        self, request: web.BaseRequest, status: int, exc: BaseException | None
    ) -> web.StreamResponse:
        started = aio.answer_started(request)
        self._seen.errors.append((status, started))
        if started:
            raise ConnectionError("started")  # as the gateway's: the connection is closed
        resp = web.Response(status=status, text="canary")
        resp.force_close()
        return resp


class _Server(aio.Server):
    seen: Seen

    def make_protocol(self, **kwargs: Any) -> web.RequestHandler:
        self.seen.kwargs = kwargs
        return _Protocol(self, **kwargs)

    def connected(self, transport: asyncio.Transport, open_connections: int) -> None:
        self.seen.connected.append(open_connections)


class _Runner(aio.Runner):
    def __init__(self, app: web.Application, seen: Seen, **kwargs: Any) -> None:
        self.seen = seen
        super().__init__(app, **kwargs)

    def adopt(self, server: web.Server) -> web.Server:
        self.seen.server_type = type(server)
        recast = aio.recast(server, _Server)
        recast.seen = self.seen
        return recast


@contextlib.asynccontextmanager
async def serve(
    routes: dict[str, Handler] | None = None, **kwargs: Any
) -> AsyncIterator[tuple[int, Seen, _Runner]]:
    app = web.Application()
    for path, handler in (routes or {}).items():
        app.router.add_route("*", path, handler)
    seen = Seen()
    runner = _Runner(app, seen, access_log=None, **kwargs)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1], seen, runner
    finally:
        await runner.cleanup()


async def exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection; everything until the server closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        with anyio.fail_after(5):
            return await reader.read()
    finally:
        writer.close()


def get(path: str, *, version: str = "1.1", extra: str = "") -> bytes:
    return f"GET {path} HTTP/{version}\r\nHost: x\r\n{extra}Connection: close\r\n\r\n".encode()


def body_of(raw: bytes) -> bytes:
    return raw.partition(b"\r\n\r\n")[2]


async def ok(request: web.Request) -> web.StreamResponse:
    return web.Response(text="ok")


# -- the connection layer ------------------------------------------------------------------------
def test_the_hooks_names_are_still_free_in_aiohttp() -> None:
    for cls, name in (
        (web.RequestHandler, "answer_error"),
        (web.Server, "make_protocol"),
        (web.Server, "connected"),
        (web.AppRunner, "adopt"),
    ):
        assert not hasattr(cls, name), breaks(
            f"{cls.__name__}.{name}", "aiohttp has a name of its own where the seam's hook is"
        )


def test_the_signatures_the_subclasses_override_or_call() -> None:
    handler_init = inspect.signature(web.RequestHandler.__init__).parameters
    assert list(handler_init)[:2] == ["self", "manager"], breaks("RequestHandler.__init__", CAP)
    assert handler_init["loop"].kind is inspect.Parameter.KEYWORD_ONLY, breaks(
        "RequestHandler.__init__(loop=)", CAP
    )
    handle_error = inspect.signature(web.RequestHandler.handle_error).parameters
    assert list(handle_error) == ["self", "request", "status", "exc", "message"], breaks(
        "RequestHandler.handle_error", MALFORMED
    )
    assert handle_error["status"].default == 500, breaks("RequestHandler.handle_error", MALFORMED)
    made = inspect.signature(web.Server.connection_made).parameters
    assert list(made) == ["self", "handler", "transport"], breaks("Server.connection_made", CAP)
    assert inspect.iscoroutinefunction(web.AppRunner._make_server), breaks(
        "AppRunner._make_server", CAP
    )
    assert list(inspect.signature(web.AppRunner._make_server).parameters) == ["self"], breaks(
        "AppRunner._make_server", CAP
    )


async def test_the_runner_builds_a_plain_server_that_is_recast() -> None:
    async with serve({"/": ok}) as (port, seen, runner):
        assert seen.server_type is web.Server, breaks(
            "AppRunner._make_server",
            f"it built a {seen.server_type}: recast would drop what that class adds; {CAP}",
        )
        assert type(runner.server) is _Server, breaks("Server.__class__ assignment", CAP)
        assert body_of(await exchange(port, get("/"))) == b"ok"
        assert seen.protocols and type(seen.protocols[0]) is _Protocol, breaks(
            "Server.__call__", "connections do not get the gateway's protocol; " + CAP
        )


async def test_each_connection_gets_the_protocol_with_the_runners_settings_and_is_counted() -> None:
    async with serve({"/": ok}, keepalive_timeout=7.5) as (port, seen, runner):
        server = runner.server
        assert server is not None
        assert isinstance(getattr(server, "_loop", None), asyncio.AbstractEventLoop), breaks(
            "Server._loop", CAP
        )
        assert isinstance(getattr(server, "_kwargs", None), dict), breaks("Server._kwargs", CAP)
        assert isinstance(getattr(server, "_connections", None), dict), breaks(
            "Server._connections", CAP
        )
        first = await asyncio.open_connection("127.0.0.1", port)
        try:
            first[1].write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # kept alive
            with anyio.fail_after(5):
                await first[0].readuntil(b"ok")
            assert body_of(await exchange(port, get("/"))) == b"ok"
        finally:
            first[1].close()
    assert seen.kwargs.get("loop") is asyncio.get_running_loop(), breaks("Server._loop", CAP)
    assert seen.kwargs.get("keepalive_timeout") == 7.5, breaks(
        "Server._kwargs", "the runner's handler settings do not reach the gateway's protocol"
    )
    assert seen.connected == [1, 2], breaks(
        "Server._connections / Server.connection_made",
        f"the open connections were counted {seen.connected}, not [1, 2]; {CAP}",
    )


async def test_the_request_loop_is_a_task_once_connected() -> None:
    async with serve({"/": ok}) as (port, seen, _):
        await exchange(port, get("/"))
    proto = seen.protocols[0]
    assert "_task_handler" in dir(proto), breaks("RequestHandler._task_handler", CAP)
    assert seen.tasks and isinstance(seen.tasks[0][0], asyncio.Task), breaks(
        "RequestHandler._task_handler",
        "after connection_made it is not the request loop's task, so a connection refused past "
        "the cap would still start its request loop; " + CAP,
    )
    assert seen.tasks[0][1] is False, breaks("RequestHandler._task_handler", CAP)


async def test_the_request_count_moves_when_a_whole_head_has_arrived() -> None:
    async with serve({"/": ok}) as (port, seen, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await seen.until(lambda: seen.protocols)
            assert isinstance(getattr(seen.protocols[0], "_request_count", None), int), breaks(
                "RequestHandler._request_count", HEAD
            )
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")
            await seen.until(lambda: seen.reads)
            assert seen.reads == [(0, 0)], breaks(
                "RequestHandler._request_count", f"it moved on a partial head; {HEAD}"
            )
            writer.write(b"Connection: close\r\n\r\n")
            with anyio.fail_after(5):
                raw = await reader.read()
        finally:
            writer.close()
    assert body_of(raw) == b"ok"
    assert seen.reads[-1] == (0, 1), breaks(
        "RequestHandler._request_count", f"a whole head did not move it; {HEAD}"
    )


async def test_a_connection_is_idle_between_requests_and_not_while_one_is_handled() -> None:
    async def handled(request: web.Request) -> web.StreamResponse:
        seen.idle.append(aio.idle(request.protocol))
        return web.Response(text="ok")

    async with serve({"/": handled}) as (port, seen, runner):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            with anyio.fail_after(5):
                await reader.readuntil(b"ok")
            assert runner.server is not None
            handlers = list(runner.server.handlers())  # type: ignore[attr-defined]
            assert handlers == seen.protocols, breaks("Server._connections", IDLE)
            writer.write(get("/"))  # the second request, on an idle connection
            with anyio.fail_after(5):
                await reader.read()
        finally:
            writer.close()
    assert "_messages" in dir(seen.protocols[0]), breaks("RequestHandler._messages", IDLE)
    # reads: the first request, the second; handlers: each request while handled.
    assert seen.idle == [True, False, True, False], breaks(
        "RequestHandler._waiter / ._messages", f"idle() read {seen.idle}; {IDLE}"
    )


async def test_the_keepalive_timer_started_on_connecting_can_be_stopped_and_restarts() -> None:
    async with serve({"/": ok}, keepalive_timeout=0.2) as (port, seen, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await seen.until(lambda: seen.protocols)
            proto = seen.protocols[0]
            assert "_keepalive_handle" in dir(proto), breaks(
                "RequestHandler._keepalive_handle", IDLE
            )
            aio.no_keepalive_yet(proto)
            assert getattr(proto, "_keepalive_handle", 0) is None, breaks(
                "RequestHandler._keepalive_handle", IDLE
            )
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            with anyio.fail_after(5):  # answered, then closed once idle for keepalive_timeout
                raw = await reader.read()
        finally:
            writer.close()
    assert body_of(raw) == b"ok", breaks("RequestHandler._keepalive_handle", IDLE)


async def test_a_request_that_is_not_http_and_a_crash_reach_handle_error() -> None:
    async def crash(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse()
        await out.prepare(request)
        await out.write(b"started")
        raise RuntimeError("crash")

    async with serve({"/crash": crash}) as (port, seen, _):
        raw = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nBad\x00Name: y\r\n\r\n")
        assert raw.split(b" ", 2)[1:2] == [b"400"] and body_of(raw) == b"canary", breaks(
            "RequestHandler.handle_error", MALFORMED
        )
        await exchange(port, get("/crash"))
    assert seen.errors == [(400, False), (500, True)], breaks(
        "RequestHandler.handle_error / BaseRequest.writer.output_size",
        f"handle_error saw {seen.errors}; {MALFORMED}, and a started answer is not closed",
    )


# -- the relay ---------------------------------------------------------------------------------
async def test_a_started_stream_has_a_plain_chunk_writer_only_where_each_write_is_a_chunk() -> None:
    found: dict[str, Any] = {}

    async def stream(request: web.Request) -> web.StreamResponse:
        out = aio.HeadWithFirstWrite()
        if request.query.get("gzip"):
            out.enable_compression()
        await out.prepare(request)
        writer = getattr(out, "_payload_writer", None)
        try:
            chunked: object = aio.chunk_writer(out)
        except AttributeError as exc:  # reported by the checks below, by name
            chunked = exc
        found[request.query_string] = (writer, request, chunked)
        await out.write(b"x")
        await out.write_eof()
        return out

    async with serve({"/": stream}) as (port, _, _):
        await exchange(port, get("/?plain=1"))
        await exchange(port, get("/?old=1", version="1.0"))
        await exchange(port, get("/?gzip=1", extra="Accept-Encoding: gzip\r\n"))
    writer, request, chunked = found["plain=1"]
    assert type(writer) is StreamWriter, breaks(
        "StreamResponse._payload_writer", "the pump never runs; " + FRAMING
    )
    assert writer is request.writer, breaks("BaseRequest.writer", MALFORMED)
    assert "_compress" in dir(writer) and writer._compress is None, breaks(
        "StreamWriter._compress", FRAMING
    )
    assert writer.transport is request.transport, breaks("StreamWriter.transport", FRAMING)
    assert writer.chunked is True and chunked is writer, breaks("StreamWriter.chunked", FRAMING)
    old, _, old_chunked = found["old=1"]
    assert old.chunked is False and old_chunked is None, breaks("StreamWriter.chunked", FRAMING)
    gzipped, _, gzip_chunked = found["gzip=1"]
    assert gzipped._compress is not None and gzip_chunked is None, breaks(
        "StreamWriter._compress", "a compressed answer would be pumped as plain chunks; " + FRAMING
    )


async def test_writes_are_framed_as_chunk_and_counted_as_the_pump_counts() -> None:
    found: dict[str, Any] = {}

    async def stream(request: web.Request) -> web.StreamResponse:
        out = aio.HeadWithFirstWrite()
        await out.prepare(request)
        writer = aio.chunk_writer(out)
        assert writer is not None
        await out.write(b"abc")  # the head leaves with it
        before = writer.buffer_size, writer.output_size
        await out.write(b"defg")
        found["write"] = (before, (writer.buffer_size, writer.output_size))
        framed = aio.chunk(b"direct")  # as the pump writes
        writer.buffer_size += len(framed)
        writer.output_size += len(framed)
        assert writer.transport is not None
        writer.transport.write(framed)
        writer.buffer_size = 0x10000  # at aiohttp's LIMIT: its next write drains
        await out.write(b"h")
        found["drained"] = writer.buffer_size
        await out.write_eof()
        return out

    async with serve({"/": stream}) as (port, _, _):
        raw = await exchange(port, get("/"))
    framed = b"".join(map(aio.chunk, [b"abc", b"defg", b"direct", b"h"])) + b"0\r\n\r\n"
    assert body_of(raw) == framed, breaks("StreamWriter.write (chunked framing)", FRAMING)
    (buffer_before, output_before), (buffer_after, output_after) = found["write"]
    for name, value in (("buffer_size", buffer_after), ("output_size", output_after)):
        assert isinstance(value, int) and isinstance(getattr(StreamWriter, name), int), breaks(
            f"StreamWriter.{name}", DRAIN
        )
    assert buffer_after - buffer_before == len(aio.chunk(b"defg")), breaks(
        "StreamWriter.buffer_size", f"write does not count the framed bytes; {DRAIN}"
    )
    assert output_after - output_before == len(aio.chunk(b"defg")), breaks(
        "StreamWriter.output_size", f"write does not count the framed bytes; {DRAIN}"
    )
    limit = inspect.signature(StreamWriter.write).parameters.get("LIMIT")
    assert limit is not None and limit.default == 0x10000, breaks("StreamWriter.write LIMIT", DRAIN)
    assert found["drained"] == 0, breaks(
        "StreamWriter.buffer_size", f"write past LIMIT did not drain and reset it; {DRAIN}"
    )


async def test_a_head_with_first_write_is_held_until_the_first_write() -> None:
    held: dict[str, int] = {}

    async def stream(request: web.Request) -> web.StreamResponse:
        cls = aio.HeadWithFirstWrite if request.query.get("late") else web.StreamResponse
        out = cls()
        await out.prepare(request)
        held[request.query_string] = request.writer.output_size
        await out.write_eof(b"x")
        return out

    for cls, value in ((web.StreamResponse, True), (web.Response, False)):
        attr = vars(cls).get("_send_headers_immediately")
        assert attr is value, breaks(
            f"{cls.__name__}._send_headers_immediately",
            "heads leave alone: one more send per stream (performance, not correctness)",
        )
    async with serve({"/": stream}) as (port, _, _):
        await exchange(port, get("/?late=1"))
        await exchange(port, get("/?early=1"))
    assert held["late=1"] == 0 and held["early=1"] > 0, breaks(
        "StreamResponse._send_headers_immediately",
        f"written at prepare {held}: heads leave alone, one more send per stream",
    )


# -- the seam holds -------------------------------------------------------------------------------
PRIVATE = {
    "_payload_writer", "_compress", "_task_handler", "_request_count", "_send_headers_immediately",
    "_make_server", "_kwargs", "_connections", "_backlog", "_ssl_context", "_sock", "__class__",
    "handle_error", "_messages", "_keepalive_handle",
}  # fmt: skip
# RequestHandler._waiter is relied on too (`aio.idle`), but the name is common (the engine
# answer's own attribute has it), so it is not in this list: `idle` is its one reader.
COUNTS = {"buffer_size", "output_size"}  # written by the pump in its per-read path, by design


def _touches(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aiohttp."):
            if node.module != "aiohttp.web":
                found.append(f"line {node.lineno}: from {node.module} import")
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("aiohttp.")]
            found += [f"line {node.lineno}: import {name}" for name in names]
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in PRIVATE:
            found.append(f"line {node.lineno}: def {node.name}")
        elif isinstance(node, ast.Name) and node.id in PRIVATE and isinstance(node.ctx, ast.Store):
            found.append(f"line {node.lineno}: {node.id} =")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in COUNTS
            and isinstance(node.ctx, ast.Store)
            and path.name != "pump.py"
        ):
            found.append(f"line {node.lineno}: .{node.attr} written")
    return found


@pytest.mark.parametrize(
    "path",
    sorted(p for p in SRC.rglob("*.py") if p.name != "_aiohttp.py"),
    ids=lambda p: str(p.relative_to(SRC)),
)
def test_only_the_seam_touches_aiohttps_private_names(path: Path) -> None:
    assert not _touches(path), f"{path.relative_to(SRC)}: through _aiohttp.py: {_touches(path)}"
