"""HTTP for canopyx_provider: the `Fetcher` interface and its default, `HttpxFetcher`.

Adapters speak to engines through the small `Fetcher` interface; `HttpxFetcher` implements it
over an injected ``httpx.AsyncClient`` and translates every httpx error into our tree here, at
one boundary. `AiohttpFetcher` (`_scrape_aiohttp.py`, asyncio only) is the other HTTP
implementation. Tests and fakes may implement `Fetcher` themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import httpx
import orjson

from ._errors import EngineUnreachableError, InfoParseError, ScrapeError, ScrapeTimeoutError

__all__ = ["Fetcher", "HttpxFetcher", "RawResponse", "map_httpx_errors"]


@dataclass(frozen=True, slots=True)
class RawResponse:
    """An engine's answer as received, before any interpretation."""

    url: str
    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    """Header names in lower case."""
    received_at: float = 0.0

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> object:
        """The body as JSON. Raises InfoParseError when it is not JSON."""
        try:
            return orjson.loads(self.body)
        except orjson.JSONDecodeError as exc:
            raise InfoParseError(f"{self.url} did not answer JSON: {exc}", url=self.url) from exc


class Fetcher(Protocol):
    """Performs one GET against an engine. The I/O plug-in point of the adapters."""

    async def get(self, url: str, *, headers: Mapping[str, str]) -> RawResponse:
        """Fetch ``url``. Raises a `ScrapeError` subclass when no answer arrives."""
        ...


class HttpxFetcher:
    """A `Fetcher` over an injected ``httpx.AsyncClient``; the client's owner closes it."""

    def __init__(
        self, client: httpx.AsyncClient, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._client = client
        self._clock = clock

    async def get(self, url: str, *, headers: Mapping[str, str]) -> RawResponse:
        with map_httpx_errors(url):
            try:
                resp = await self._client.get(url, headers=headers)
            except httpx.RemoteProtocolError:
                # An engine may close a kept-alive connection just as we reuse it (llama.cpp's
                # router was seen doing so); the GET then meets a connection that ends without
                # an answer. A GET is idempotent and httpx has dropped that connection, so ask
                # once more on a fresh one, as browsers and urllib3 do. Once only: an engine
                # that keeps breaking its answers is reported as it is.
                resp = await self._client.get(url, headers=headers)
        return RawResponse(
            url=url,
            status=resp.status_code,
            body=resp.content,
            headers={k.lower(): v for k, v in resp.headers.items()},
            received_at=self._clock(),
        )

    def __repr__(self) -> str:
        return f"<HttpxFetcher {self._client!r}>"


@contextmanager
def map_httpx_errors(url: str) -> Iterator[None]:
    """Translate httpx's errors into canopyx's, most specific first."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise ScrapeTimeoutError(
            f"{url}: no answer in time ({type(exc).__name__})", url=url
        ) from exc
    except (httpx.NetworkError, httpx.ProxyError, httpx.UnsupportedProtocol) as exc:
        raise EngineUnreachableError(
            f"{url}: engine unreachable ({type(exc).__name__}: {exc})", url=url
        ) from exc
    except (httpx.ProtocolError, httpx.DecodingError, httpx.TooManyRedirects) as exc:
        raise ScrapeError(f"{url}: broken answer ({type(exc).__name__}: {exc})", url=url) from exc
    except httpx.TransportError as exc:  # any subclass httpx adds later
        raise ScrapeError(f"{url}: transport error ({type(exc).__name__}: {exc})", url=url) from exc
