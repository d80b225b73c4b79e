"""A `Fetcher` over aiohttp, for asyncio programs that want the cheaper client.

`HttpxFetcher` stays the default (it runs under trio too); `AiohttpFetcher` runs under asyncio
only and costs less CPU per GET. Like `_scrape.py` for httpx, this module is the one boundary where
aiohttp's errors become canopyx's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from ._errors import ConfigError, EngineUnreachableError, ScrapeError, ScrapeTimeoutError
from ._scrape import RawResponse

__all__ = ["AiohttpFetcher", "map_aiohttp_errors"]

_IDENTITY = {"Accept-Encoding": "identity"}

# An answer that arrived broken: the connection closed before or inside it, it did not parse, or
# it pointed somewhere we do not follow. Checked before _UNREACHABLE, which includes their bases.
_BROKEN: tuple[type[BaseException], ...] = (
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientResponseError,
    aiohttp.ClientPayloadError,
    aiohttp.RedirectClientError,
    HttpProcessingError,
)
_UNREACHABLE: tuple[type[BaseException], ...] = (
    aiohttp.ClientConnectionError,  # refused, reset, DNS, TLS, ...
    aiohttp.InvalidURL,
    aiohttp.NonHttpUrlClientError,
    OSError,
)


class AiohttpFetcher:
    """A `Fetcher` over an injected ``aiohttp.ClientSession`` (asyncio only); the session's owner
    closes it.

    Each GET is bounded by ``timeout_s`` in total (connecting, the answer and its body) and does
    not follow redirects. It asks for the body uncompressed (``Accept-Encoding: identity``)
    unless the caller's headers say otherwise; an engine that compresses anyway is decoded by
    the session, which must therefore keep aiohttp's default ``auto_decompress=True``.

    A GET that meets a kept-alive connection the engine closed without answering is retried once
    on a new connection by aiohttp itself (it does so for every idempotent request, since 3.9);
    a second failure is reported as a broken answer. This fetcher adds no retry of its own.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        timeout_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be above 0 seconds, not {timeout_s!r}")
        if not session.auto_decompress:
            raise ConfigError(
                "AiohttpFetcher needs a session that decodes compressed answers "
                "(auto_decompress=True, aiohttp's default)"
            )
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._clock = clock

    async def get(self, url: str, *, headers: Mapping[str, str]) -> RawResponse:
        sent = _IDENTITY
        if headers:
            sent = dict(headers)
            if not any(name.lower() == "accept-encoding" for name in sent):
                sent["Accept-Encoding"] = "identity"
        with map_aiohttp_errors(url):
            async with self._session.get(
                url, headers=sent, allow_redirects=False, timeout=self._timeout
            ) as resp:
                body = await resp.read()
                status = resp.status
                received = {k.lower(): v for k, v in resp.headers.items()}
        return RawResponse(
            url=url, status=status, body=body, headers=received, received_at=self._clock()
        )

    def __repr__(self) -> str:
        return f"<AiohttpFetcher {self._session!r} timeout={self._timeout.total}s>"


@contextmanager
def map_aiohttp_errors(url: str) -> Iterator[None]:
    """Translate aiohttp's errors into canopyx's, most specific first."""
    try:
        yield
    except TimeoutError as exc:  # aiohttp's total timeout, and its ServerTimeoutError family
        raise ScrapeTimeoutError(
            f"{url}: no answer in time ({type(exc).__name__})", url=url
        ) from exc
    except _BROKEN as exc:
        raise ScrapeError(f"{url}: broken answer ({type(exc).__name__}: {exc})", url=url) from exc
    except _UNREACHABLE as exc:
        raise EngineUnreachableError(
            f"{url}: engine unreachable ({type(exc).__name__}: {exc})", url=url
        ) from exc
    except aiohttp.ClientError as exc:  # any subclass aiohttp adds later
        raise ScrapeError(f"{url}: transport error ({type(exc).__name__}: {exc})", url=url) from exc
    except ValueError as exc:  # a request aiohttp would not send (a header with a newline, ...)
        raise ScrapeError(
            f"{url}: request not sent ({type(exc).__name__}: {exc})", url=url
        ) from exc
