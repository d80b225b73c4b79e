"""`PlainRoutes` (``_aiohttp.py``), every listener's dispatch: a request for a route with no
variable part goes straight to its handler with the match info aiohttp made for the first such
request; each answer is the one aiohttp's own router gives, over a real socket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capyctl_gateway import _aiohttp as aio
from tests.eventually import eventually

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE")
PATHS = (
    "/a", "/a/", "/A", "/a?x=1", "/a%2Fb", "/a/b", "/b", "/b/", "//a", "/m/x", "/m/%2F", "/m",
    "/m/x/y", "/", "/c%61", "/a/../a", "/%7E", "/b/c", "/b%2Fc", "/b%2fc", "/%61",
)  # fmt: skip


def _app(middleware: bool = False) -> tuple[web.Application, list[object], list[object]]:
    """An application with the public listener's kinds of routes: plain ones for one method,
    and for any other (a wrong method's answer), and one with a variable part; each handler
    answers its name, whether ``request.app`` is this application and its match info's
    mapping. The lists: every request that passed a middleware, and each request's match
    info (kept alive, so that two are the same object only if they are)."""
    passed: list[object] = []
    infos: list[object] = []
    middlewares = []
    if middleware:

        @web.middleware
        async def note(request: web.Request, handler: Handler) -> web.StreamResponse:
            passed.append(request)
            return await handler(request)

        middlewares.append(note)
    app = web.Application(middlewares=middlewares)

    def named(name: str) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            infos.append(request.match_info)
            same = request.app is app
            return web.Response(text=f"{name}|{same}|{dict(request.match_info)}")

        return handler

    app.router.add_post("/a", named("post a"))
    app.router.add_get("/a", named("get a"))
    app.router.add_route("*", "/a", named("any a"))
    app.router.add_put("/b", named("put b"))
    app.router.add_post("/b/c", named("post b/c"))
    app.router.add_get("/m/{x:[\\s\\S]+}", named("get m"))
    app.router.add_get("/m", named("get m plain"))

    async def prepared(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["X-Prepared"] = "yes"  # the prepare hook reads the match info

    app.on_response_prepare.append(prepared)
    return app, passed, infos


@asynccontextmanager
async def serving(
    app: web.Application, **settings: Any
) -> AsyncIterator[tuple[int, aio.PlainRoutes]]:
    runner = aio.Runner(app, **settings)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = runner.server
    assert server is not None and isinstance(server.request_handler, aio.PlainRoutes)
    try:
        yield site._server.sockets[0].getsockname()[1], server.request_handler  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


class Conn:
    """One keep-alive connection that sends request targets as they are written."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(
        self, method: str, target: str, extra: str = ""
    ) -> tuple[int, dict[str, str], str]:
        self.writer.write(
            f"{method} {target} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n{extra}\r\n".encode()
        )
        return await self.answer(head_only=method == "HEAD")

    async def answer(self, *, head_only: bool = False) -> tuple[int, dict[str, str], str]:
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode()
        status = int(head.split(" ", 2)[1])
        headers = {}
        for line in head.split("\r\n")[1:]:
            if line:
                name, value = line.split(":", 1)
                headers[name.lower()] = value.strip()
        size = 0 if head_only or status < 200 else int(headers.get("content-length", 0))
        body = (await self.reader.readexactly(size)).decode()
        return status, headers, body


@asynccontextmanager
async def connected(port: int) -> AsyncIterator[Conn]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield Conn(reader, writer)
    finally:
        writer.close()
        await writer.wait_closed()


async def _aiohttps_answer(app: web.Application, method: str, target: str) -> tuple[int, str]:
    """What aiohttp's own router makes of a request: the status of its refusal, or 200 and the
    name of the handler it chose."""
    info = await app.router.resolve(make_mocked_request(method, target, app=app))
    if info.http_exception is not None:
        return info.http_exception.status, ""
    response = await info.handler(make_mocked_request(method, target, app=app))
    assert isinstance(response, web.Response) and response.text is not None
    return 200, response.text.split("|")[0]


async def _same_as_aiohttp(requests: list[tuple[str, str]]) -> None:
    app, _, _ = _app()
    async with serving(app) as (port, routes), connected(port) as conn:
        for method, target in requests:
            status, headers, body = await conn.send(method, target)
            want_status, want_name = await _aiohttps_answer(app, method, target)
            assert status == want_status, (method, target, body)
            assert headers.get("x-prepared") == "yes", (method, target)
            if status == 200 and method != "HEAD":
                name, same, _ = body.split("|")
                assert name == want_name, (method, target)
                assert same == "True"  # request.app is the application
        # Only plain routes for their own method are kept, one for each at most.
        plain = {(r.method, r.resource.canonical) for r in app.router.routes()
                 if isinstance(r.resource, web.PlainResource) and r.method != "*"}  # fmt: skip
        assert set(routes._kept) <= plain


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(METHODS), st.sampled_from(PATHS)), max_size=30))
def test_each_request_is_answered_as_aiohttps_router_answers_it(
    requests: list[tuple[str, str]],
) -> None:
    anyio.run(_same_as_aiohttp, requests, backend="asyncio")


def test_every_method_and_target_twice_is_answered_as_aiohttps_router_answers_it() -> None:
    """Each pair once while nothing is kept and once more with every plain route kept."""
    pairs = [(method, path) for method in METHODS for path in PATHS]
    anyio.run(_same_as_aiohttp, pairs * 2, backend="asyncio")


@pytest.mark.anyio
async def test_a_plain_route_keeps_one_match_info_and_a_variable_one_makes_each_anew() -> None:
    app, _, infos = _app()
    async with serving(app) as (port, routes), connected(port) as conn:
        for _ in range(3):
            assert (await conn.send("POST", "/a"))[0] == 200
        variable = [(await conn.send("GET", f"/m/{i}"))[2] for i in range(3)]
    plain, made = infos[:3], infos[3:]
    assert plain[1] is plain[0] and plain[2] is plain[0]  # kept after the first request
    assert made[0] is not made[1] and made[1] is not made[2] and made[0] is not made[2]
    assert [b.split("|")[2] for b in variable] == [f"{{'x': '{i}'}}" for i in range(3)]
    assert list(routes._kept) == [("POST", "/a")]


@pytest.mark.anyio
async def test_an_expect_header_still_gets_its_interim_answer_on_a_kept_route() -> None:
    app, _, _ = _app()
    async with serving(app) as (port, _routes), connected(port) as conn:
        assert (await conn.send("POST", "/a"))[0] == 200  # the route is kept now
        conn.writer.write(
            b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
        )
        interim = await conn.reader.readuntil(b"\r\n\r\n")
        assert interim.startswith(b"HTTP/1.1 100 Continue")
        conn.writer.write(b"{}")
        status, _, body = await conn.answer()
    assert status == 200 and body.startswith("post a|")


@pytest.mark.anyio
async def test_an_application_with_a_middleware_goes_through_it_every_time() -> None:
    app, passed, _ = _app(middleware=True)
    async with serving(app) as (port, routes), connected(port) as conn:
        for _ in range(4):
            assert (await conn.send("POST", "/a"))[0] == 200
    assert len(passed) == 4
    assert routes._kept == {}


@pytest.mark.anyio
async def test_many_paths_keep_no_more_than_the_plain_routes() -> None:
    """The kept match infos are bounded by the routes, whatever paths clients send."""
    app, _, _ = _app()
    async with serving(app) as (port, routes), connected(port) as conn:
        for i in range(200):
            await conn.send("POST" if i % 2 else "GET", f"/a/{i}" if i % 3 else "/a")
            await conn.send("GET", f"/m/{i}")
    assert set(routes._kept) == {("POST", "/a"), ("GET", "/a")}


@pytest.mark.anyio
async def test_many_clients_at_once_with_hang_ups_lose_nothing_on_a_kept_route() -> None:
    """Forty requests at once on a kept route, half of whose clients hang up while their
    handlers wait, beside requests for other routes: each hung-up handler is cancelled (as the
    gateway's hang-up detection needs), each other one answered, and every connection usable
    for its next request."""
    app = web.Application()
    running: list[int] = []
    cancelled: list[int] = []
    answered: list[int] = []
    release = asyncio.Event()

    async def waits(request: web.Request) -> web.StreamResponse:
        n = int(request.query["n"])
        running.append(n)
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled.append(n)
            raise
        answered.append(n)
        return web.Response(text=f"done {n}")

    async def other(request: web.Request) -> web.StreamResponse:
        return web.Response(text=f"other {request.match_info['x']}")

    app.router.add_post("/a", waits)
    app.router.add_get("/m/{x}", other)
    async with serving(app, handler_cancellation=True) as (port, routes):
        release.set()
        async with connected(port) as first:
            assert (await first.send("POST", "/a?n=-1"))[2] == "done -1"  # kept from now on
        release.clear()
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(40)]
        for n, (_, writer) in enumerate(conns):
            writer.write(f"POST /a?n={n} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
        await eventually(lambda: len(running) == 41)
        for _, writer in conns[::2]:
            writer.close()  # the client hangs up while its handler waits
        async with connected(port) as beside:  # other routes meanwhile
            for i in range(5):
                assert (await beside.send("GET", f"/m/{i}"))[2] == f"other {i}"
                assert (await beside.send("GET", "/nowhere"))[0] == 404
        await eventually(lambda: sorted(cancelled) == list(range(0, 40, 2)))
        release.set()
        for n, (reader, writer) in list(enumerate(conns))[1::2]:
            conn = Conn(reader, writer)
            assert (await conn.answer())[2] == f"done {n}"
            assert (await conn.send("POST", f"/a?n={n + 100}"))[2] == f"done {n + 100}"
            writer.close()
        assert sorted(answered) == [-1, *range(1, 40, 2), *range(101, 140, 2)]
        assert list(routes._kept) == [("POST", "/a")]
