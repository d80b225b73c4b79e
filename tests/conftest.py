"""Shared test helpers: recorded engine answers, served over real sockets."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

RECORDED = Path(__file__).resolve().parent.parent / "contract" / "recorded"


@dataclass(frozen=True)
class Recording:
    """One recorded HTTP answer: status line, headers and body as the engine sent them."""

    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()

    def response(self) -> Response:
        # The body was stored de-chunked: framing headers of the capture do not apply to a replay.
        hop = {"content-length", "transfer-encoding", "connection", "keep-alive"}
        headers = {k: v for k, v in self.headers.items() if k.lower() not in hop}
        return Response(self.body, status=self.status, headers=headers)


def recorded(rel: str) -> Recording:
    """Load ``contract/recorded/<rel>`` (an ``.http`` file: status line, headers, body)."""
    raw = (RECORDED / rel).read_bytes()
    if not rel.endswith(".http"):
        return Recording(200, {}, raw)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip()] = value.strip()
    return Recording(status, headers, body)


def serve(server: HTTPServer, path: str, rel: str, **match: object) -> None:
    """Answer ``path`` on ``server`` with a recording, every time it is asked."""
    server.expect_request(path, **match).respond_with_response(recorded(rel).response())  # type: ignore[arg-type]


def requests_to(server: HTTPServer, path: str) -> list[Request]:
    return [req for req, _ in server.log if req.path == path]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine(httpserver: HTTPServer) -> Iterator[HTTPServer]:
    """A real loopback HTTP server to play an engine; cleared after each test."""
    yield httpserver
    httpserver.clear()


@pytest.fixture
def threaded_engine() -> Iterator[HTTPServer]:
    """Like ``engine``, but each request gets its own thread (for handlers that stall)."""
    server = HTTPServer(host="127.0.0.1", threaded=True)
    server.start()
    try:
        yield server
    finally:
        server.clear()
        server.stop()
