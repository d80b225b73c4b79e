"""AiohttpFetcher over real loopback sockets (asyncio only)."""

from __future__ import annotations

import gzip
import socket
import ssl
from collections.abc import AsyncIterator, Iterator

import aiohttp
import anyio
import pytest
from aiohttp.client_exceptions import UnixClientConnectorError
from aiohttp.client_reqrep import ConnectionKey
from multidict import CIMultiDict, CIMultiDictProxy
from pytest_httpserver import HTTPServer
from werkzeug import Response
from yarl import URL

from canopyx_provider import (
    AiohttpFetcher,
    Collector,
    ConfigError,
    EngineUnreachableError,
    ProviderOptions,
    ScrapeError,
    ScrapeTimeoutError,
    vllm,
)
from canopyx_provider._scrape_aiohttp import map_aiohttp_errors
from tests.conftest import requests_to
from tests.provider.fakes import DroppingServer, RawServer, subclasses_of, vllm_031

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # aiohttp runs on asyncio only


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as s:
        yield s


@pytest.fixture
def dropping() -> Iterator[DroppingServer]:
    server = DroppingServer()
    yield server
    server.close()


class OneAnswerServer(RawServer):
    """A raw server that reads one request per connection, writes ``answer`` and closes."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        super().__init__()

    def handle(self, conn: socket.socket, n: int) -> None:
        self.read_head(conn)
        conn.sendall(self.answer)


async def test_a_200_gives_status_body_and_lower_cased_headers(
    engine: HTTPServer, session: aiohttp.ClientSession
) -> None:
    engine.expect_request("/metrics").respond_with_response(
        Response(b"vllm:num_requests_running 0\n", headers={"X-Engine-Thing": "a"})
    )
    fetcher = AiohttpFetcher(session, timeout_s=5, clock=lambda: 1234.5)
    url = engine.url_for("/metrics")
    resp = await fetcher.get(url, headers={"Authorization": "Bearer k"})
    assert (resp.url, resp.status, resp.body) == (url, 200, b"vllm:num_requests_running 0\n")
    assert resp.headers["x-engine-thing"] == "a"
    assert all(name == name.lower() for name in resp.headers)
    assert resp.received_at == 1234.5
    (request,) = requests_to(engine, "/metrics")
    assert request.headers["Authorization"] == "Bearer k"
    assert request.headers["Accept-Encoding"] == "identity"  # no compression asked for


async def test_a_compressed_answer_is_decoded_anyway(
    engine: HTTPServer, session: aiohttp.ClientSession
) -> None:
    page = b"vllm:num_requests_running 0\n" * 100
    engine.expect_request("/metrics").respond_with_response(
        Response(gzip.compress(page), headers={"Content-Encoding": "gzip"})
    )
    resp = await AiohttpFetcher(session, timeout_s=5).get(engine.url_for("/metrics"), headers={})
    assert resp.body == page


async def test_a_caller_may_ask_for_compression_itself(
    engine: HTTPServer, session: aiohttp.ClientSession
) -> None:
    engine.expect_request("/metrics").respond_with_data(b"x")
    fetcher = AiohttpFetcher(session, timeout_s=5)
    await fetcher.get(engine.url_for("/metrics"), headers={"accept-encoding": "gzip"})
    (request,) = requests_to(engine, "/metrics")
    assert request.headers.getlist("Accept-Encoding") == ["gzip"]


async def test_other_statuses_and_redirects_are_passed_through(
    engine: HTTPServer, session: aiohttp.ClientSession
) -> None:
    engine.expect_request("/health").respond_with_data(b"loading", status=503)
    engine.expect_request("/metrics").respond_with_response(
        Response(b"", status=302, headers={"Location": "/elsewhere"})
    )
    fetcher = AiohttpFetcher(session, timeout_s=5)
    health = await fetcher.get(engine.url_for("/health"), headers={})
    assert (health.status, health.body) == (503, b"loading")
    moved = await fetcher.get(engine.url_for("/metrics"), headers={})
    assert (moved.status, moved.headers["location"]) == (302, "/elsewhere")
    assert requests_to(engine, "/elsewhere") == []


async def test_a_refused_connection_is_unreachable(session: aiohttp.ClientSession) -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/health"
    with pytest.raises(EngineUnreachableError) as info:
        await AiohttpFetcher(session, timeout_s=5).get(url, headers={})
    assert info.value.url == url


async def test_a_header_that_cannot_be_sent_is_a_scrape_error_and_sends_nothing(
    session: aiohttp.ClientSession, engine: HTTPServer
) -> None:
    engine.expect_request("/health").respond_with_data("")
    with pytest.raises(ScrapeError, match="request not sent"):
        await AiohttpFetcher(session, timeout_s=5).get(
            engine.url_for("/health"), headers={"Authorization": "Bearer a\nInjected: 1"}
        )
    assert requests_to(engine, "/health") == []


async def test_an_engine_that_never_answers_times_out_within_the_timeout(
    session: aiohttp.ClientSession,
) -> None:
    # A listening socket nobody accepts from: the kernel completes the handshake, takes the
    # request and nothing ever answers.
    with socket.create_server(("127.0.0.1", 0)) as sock:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"
        fetcher = AiohttpFetcher(session, timeout_s=0.3)
        started = anyio.current_time()
        with anyio.fail_after(5), pytest.raises(ScrapeTimeoutError) as info:
            await fetcher.get(url, headers={})
        elapsed = anyio.current_time() - started
    assert info.value.url == url
    assert 0.25 <= elapsed < 1.5


async def test_a_kept_alive_connection_closed_under_a_get_is_retried_once_on_a_new_one(
    dropping: DroppingServer, session: aiohttp.ClientSession
) -> None:
    url = f"http://127.0.0.1:{dropping.port}/health"
    fetcher = AiohttpFetcher(session, timeout_s=5)
    assert (await fetcher.get(url, headers={})).status == 200
    second = await fetcher.get(url, headers={})  # meets the closed connection first
    assert (second.status, second.body) == (200, b'{"status":"ok"}')
    assert (dropping.connections, dropping.answered) == (2, 2)


async def test_an_engine_that_always_drops_the_connection_is_a_broken_answer(
    session: aiohttp.ClientSession,
) -> None:
    server = DroppingServer(always=True)
    url = f"http://127.0.0.1:{server.port}/health"
    try:
        with pytest.raises(ScrapeError, match="broken answer") as info:
            await AiohttpFetcher(session, timeout_s=5).get(url, headers={})
    finally:
        server.close()
    assert not isinstance(info.value, (EngineUnreachableError, ScrapeTimeoutError))
    assert server.connections == 2  # one retry, not more


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",  # body cut off
        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 5\r\n\r\nnope!",
        b"NOT HTTP AT ALL\r\n\r\n",
    ],
    ids=["truncated", "bad-gzip", "not-http"],
)
async def test_an_answer_that_does_not_parse_is_a_broken_answer(
    answer: bytes, session: aiohttp.ClientSession
) -> None:
    server = OneAnswerServer(answer)
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        with pytest.raises(ScrapeError, match="broken answer") as info:
            await AiohttpFetcher(session, timeout_s=5).get(url, headers={})
    finally:
        server.close()
    assert type(info.value) is ScrapeError


async def test_a_session_that_does_not_decompress_and_a_zero_timeout_are_refused(
    session: aiohttp.ClientSession,
) -> None:
    async with aiohttp.ClientSession(auto_decompress=False) as raw:
        with pytest.raises(ConfigError, match="auto_decompress"):
            AiohttpFetcher(raw, timeout_s=1)
    with pytest.raises(ConfigError, match="timeout_s"):
        AiohttpFetcher(session, timeout_s=0)


def _instance(cls: type[aiohttp.ClientError]) -> aiohttp.ClientError:
    """One instance of any aiohttp error class, built the way its family's constructor wants."""
    key = ConnectionKey("engine", 8000, False, True, None, None, None)
    url = URL("http://engine:8000/metrics")
    refused = ConnectionRefusedError(111, "refused")
    if issubclass(cls, aiohttp.ClientResponseError):
        return cls(aiohttp.RequestInfo(url, "GET", CIMultiDictProxy(CIMultiDict()), url), ())
    if issubclass(cls, UnixClientConnectorError):
        return cls("/run/engine.sock", key, refused)
    if issubclass(cls, aiohttp.ClientConnectorCertificateError):
        return cls(key, ssl.SSLCertVerificationError("bad certificate"))
    if issubclass(cls, aiohttp.ClientConnectorError):
        return cls(key, refused)
    if issubclass(cls, aiohttp.ServerFingerprintMismatch):
        return cls(b"a", b"b", "engine", 8000)
    return cls("boom")


def test_every_aiohttp_error_is_mapped() -> None:
    classes = subclasses_of(aiohttp.ClientError)
    assert len(classes) > 20
    for cls in classes:
        with pytest.raises(ScrapeError) as info, map_aiohttp_errors("http://e"):
            raise _instance(cls)
        assert info.value.url == "http://e"
        if issubclass(cls, TimeoutError):
            assert isinstance(info.value, ScrapeTimeoutError), cls
        elif issubclass(
            cls, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)
        ) or issubclass(cls, aiohttp.ClientResponseError):
            assert type(info.value) is ScrapeError, cls
            assert "broken answer" in info.value.message
        elif issubclass(cls, (aiohttp.ClientConnectorError, aiohttp.ClientOSError)):
            assert isinstance(info.value, EngineUnreachableError), cls
    for exc in (TimeoutError(), ConnectionResetError(104, "reset"), OSError(113, "no route")):
        with pytest.raises(ScrapeError) as info, map_aiohttp_errors("http://e"):
            raise exc
        expected = ScrapeTimeoutError if isinstance(exc, TimeoutError) else EngineUnreachableError
        assert type(info.value) is expected


async def test_a_collector_with_the_aiohttp_fetcher_checks_and_refreshes_vllm(
    engine: HTTPServer, session: aiohttp.ClientSession
) -> None:
    vllm_031(engine)
    options = ProviderOptions(request_timeout_ms=2000, connect_attempts=1)
    fetcher = AiohttpFetcher(session, timeout_s=options.request_timeout_s)
    async with Collector(options=options, fetcher=fetcher) as c:
        c.add("e", vllm(engine.url_for("/")), model_id="tiny", poll=False)
        report = await c.check("e")
        assert [(r.name, r.ok) for r in report.checks] == [
            ("health", True),
            ("models", True),
            ("discovery", True),
            ("metrics", True),
        ]
        assert report.engine_version == "0.31.0"
        scraped = len(requests_to(engine, "/metrics"))  # by discovery and the metrics check
        snap = await c.refresh("e")
    assert snap is not None
    assert snap.engine_version == "0.31.0"
    assert snap.metrics.running_requests == 0
    assert snap.metrics.kv_cache_usage_ratio is not None
    assert len(requests_to(engine, "/metrics")) == scraped + 1
    assert not session.closed  # the session's owner closes it
