"""One exchange with one engine instance, from the POST to the connection's fate (hot path).

`Exchange` is the only code that talks to an engine's chat or decision endpoint. Used as
``async with``, it owns:

* the POST (never following a redirect: an engine that redirects has failed);
* the deadline: the request deadline until output starts, then the stream idle timeout, pushed
  back only by output the caller relays (`Exchange.output`), never by pings;
* the one mapping of what can go wrong to the error tree: a connection that was never
  established is `NotAcceptedError` (the engine never got it; another instance may), any other
  aiohttp error is `EngineError`, our deadline is `UnavailableError`, a client that went away while
  we wrote is `ClientGoneError`, and a cancellation (aiohttp's, on a hang-up) stays one;
* the `Outcome`, read afterwards to charge or settle the request, with its `Ending`: the
  exchange is the only writer of how a request that reached an engine ended;
* the end: an answer that ended on the engine's terms returns its connection to the pool
  (after waiting briefly for the chunked body's end); anything else closes it, and the close is
  what tells the engine to stop.

Client-facing messages name the deployment and instance; the aiohttp text goes in ``detail``.
Never imports the HTTP surface or the deployments.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType

import aiohttp
from yarl import URL

from .. import _clock
from .._engine_client import Body, EngineClient, EngineResponse
from .._errors import EngineError
from .._loop import running_loop
from .._telemetry import CUTS, Ending
from .deadline import Deadline
from .ending import DRAIN_S, _failure, _finish
from .refusal import forwarded, refusal

__all__ = ["DRAIN_S", "Exchange", "Outcome", "beside"]

logger = logging.getLogger(__name__)

Answer = EngineResponse


@dataclass(slots=True)
class Outcome:
    """How the exchange ended, for the caller's accounting and logs."""

    sent: bool = False
    """The request may have reached the engine."""
    completed: bool = False
    """The engine's answer ended on its own terms ([DONE], a whole answer, or a refusal)."""
    ending: Ending | None = None
    """How it ended (None while it runs)."""
    answered: bool = False
    """The engine produced part of the answer, or an error, before the end."""
    error: str | None = None
    """What went wrong with the engine, for the log."""
    head_at: float | None = None
    """Loop time when the engine's answer's head arrived."""
    first_content_at: float | None = None
    last_at: float | None = None
    """Loop times of the first content and the last chunk relayed (or read)."""
    ttft: float | None = None
    """The time to first token its answer reported (the ``ttft_ms`` figure, in seconds);
    None where the answer reported none."""

    @property
    def cut(self) -> str | None:
        """Why the gateway cut it short (hang_up, deadline, idle_timeout); None otherwise."""
        ending = self.ending
        return ending.value if ending is not None and ending in CUTS else None


class Exchange:
    """One POST to one engine instance and everything up to its connection's release."""

    __slots__ = (
        "_abortable",
        "_abort_code",
        "_aborted",
        "_bound",
        "_clean",
        "_deadline",
        "_drains",
        "_headers",
        "_posting",
        "_session",
        "_started",
        "_url",
        "idle_timeout",
        "outcome",
        "response",
        "started",
        "where",
        "writing",
    )

    def __init__(
        self,
        session: EngineClient,
        url: URL,
        headers: dict[str, str],
        *,
        where: str,
        deadline: float,
        idle_timeout: float,
        drains: set[asyncio.Task[None]],
    ) -> None:
        """``where``: how clients hear of this instance ("deployment tiny, instance 0").
        ``deadline``: loop time by which output must start. ``drains``: where connections
        waiting for their body's end are kept, for the gateway to cancel at shutdown."""
        self._session = session
        self._url = url
        self._headers = headers
        self.where = where
        self.idle_timeout = idle_timeout  # the Messages API pings at a quarter of it
        self._drains = drains
        self._deadline = deadline
        self._bound: Deadline
        self._started = False
        self._clean = False
        self.outcome = Outcome()
        self.response: Answer | None = None
        # Set while the caller writes to its client: a deadline that passes then means the
        # client stopped reading (a write that cannot drain), which is a hang-up.
        self.writing = False
        self._aborted: str | None = None
        self._abort_code = "engine_error"
        self._abortable = False
        self._posting: asyncio.Task[Answer] | None = None
        self.started: Callable[[], None] | None = None  # told once, as output starts

    def abort(self, why: str, code: str = "engine_error") -> None:
        """End the exchange now from outside (the gateway stopping, an operator's stop, its
        engine's host gone): the engine connection is closed, and the caller hears ``why``
        with ``code`` (`ended_by_gateway`)."""
        self._aborted, self._abort_code = why, code
        if self.response is not None:
            self.response.close()  # the read in progress fails
        elif self._posting is not None:
            self._posting.cancel()

    # -- the exchange ------------------------------------------------------------------
    async def post(self, payload: bytes, path: str | None = None) -> Answer:
        """Send the request (to ``path`` on its engine); return the answer's head, whatever."""
        self.outcome.sent = True
        url = self._url if path is None else beside(self._url, path)
        posting: Awaitable[Answer] = self._session.post(url, data=payload, headers=self._headers)
        if not self._abortable:
            self.response = await posting
        else:  # a remote instance: the POST runs as a task that abort() can cancel
            self._posting = task = asyncio.ensure_future(posting, loop=running_loop())
            self.response = await _aborted_or(self, task)
            if self._aborted is not None:  # aborted as the head arrived: too late to cancel
                self.response.close()
                raise aiohttp.ServerDisconnectedError(self._aborted)
        self.outcome.head_at = _clock.now()
        return self.response

    def abortable(self) -> None:
        """Let `abort` end this exchange before the engine's answer has a head too."""
        self._abortable = True

    async def open_stream(self, payload: bytes) -> Body:
        """Send the request and return the engine's event stream; a refusal or an answer that
        is not a stream raises here."""
        resp = await self.post(payload)
        if resp.status != 200:
            forwarded(self, resp)
            self.outcome.completed = True  # an answer, not a stream: nothing runs on
            raise await refusal(resp, self.where)
        ctype = resp.headers.get("Content-Type", "")
        if not ctype.startswith("text/event-stream"):
            raise EngineError(
                f"{self.where}: the engine answered {ctype or 'no content type'}, not a stream"
            )
        return resp.content

    def output(self, now: float) -> None:
        """Output was relayed at ``now``: the stream may now be quiet for the idle timeout."""
        if (told := self.started) is not None:  # a worker's word that its engine answered
            self.started = None
            told()
        self._started = True
        self._bound.move(now + self.idle_timeout)

    def complete(self) -> None:
        """The engine's answer ended on its own terms; its connection may be pooled."""
        self._clean = self.outcome.completed = True

    # -- the frame ---------------------------------------------------------------------
    async def __aenter__(self) -> Exchange:
        # Armed first for the idle timeout, which output starting will move it to: one re-arm
        # saved on most requests (see Deadline).
        first = running_loop().time() + self.idle_timeout
        self._bound = Deadline(self._deadline, first_check=first)
        self._bound.__enter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:  # the common case, kept cheap
            self.outcome.ending = Ending.COMPLETED
            self._bound.__exit__(None, None, None)
            _finish(self.response, self._clean, self._drains)
            return
        error: BaseException | None = exc
        try:
            try:
                self._bound.__exit__(exc_type, exc, tb)
            except TimeoutError as timeout:  # our deadline turned a cancellation into this
                error = timeout
            if error is not None:
                error = _failure(self, error)
        finally:
            _finish(self.response, self._clean, self._drains)
        if error is not None and error is not exc:
            raise error from exc


@functools.lru_cache(maxsize=256)
def beside(url: URL, path: str) -> URL:
    """``path`` on the engine of ``url`` (its chat endpoint, under any prefix before it): one
    object per URL, as the engine client keeps its requests' heads by it."""
    base = url.path.removesuffix("/v1/chat/completions")
    return url.with_path(base + path)


async def _aborted_or(ex: Exchange, task: asyncio.Task[Answer]) -> Answer:
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task(running_loop())
        if ex._aborted is None or (current is not None and current.cancelling()):
            raise
        raise aiohttp.ServerDisconnectedError(ex._aborted) from None
