"""How an exchange ends (`exchange.Exchange` calls these, once per request, never per chunk).

* `_failure`: the one mapping of what went wrong to the error tree, noting the `Ending` on the
  exchange's `Outcome` (see the exchange's docstring for the mapping itself);
* `ended_by_gateway`: what a request the gateway itself ended (`Exchange.abort`) hears;
* `_finish`: the engine connection's fate: pooled after a whole answer (after waiting up to
  `DRAIN_S` for the chunked body's end), closed otherwise, the close being what tells the engine
  to stop.

Never imports the HTTP surface or the deployments.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import aiohttp

from .._engine_client import EngineConnectError, EngineConnectionError
from .._errors import (
    ClientGoneError,
    DeploymentStoppedError,
    EngineError,
    EngineRejectedError,
    GatewayError,
    NotAcceptedError,
    UnavailableError,
    UnverifiedError,
)
from .._loop import running_loop
from .._telemetry import Ending
from .deadline import Deadline
from .refusal import EngineRefusalError, fit_for_client, fit_for_log

if TYPE_CHECKING:
    from .exchange import Answer, Exchange

__all__ = ["DRAIN_S", "ended_by_gateway"]

DRAIN_S = 1.0
"""How long a finished exchange waits for the end of the engine's body to pool its connection."""
_NEVER_CONNECTED = (
    aiohttp.ClientConnectorError,
    aiohttp.ConnectionTimeoutError,
    EngineConnectError,
)
_BROKEN = (aiohttp.ClientError, EngineConnectionError)
MAX_DETAIL = 200
"""What the log keeps of what an engine said in a stream that failed verification."""


def ended_by_gateway(code: str, why: str) -> GatewayError:
    """What a request the gateway itself ended hears (`Tracked.abort`), by ``code``: the gateway
    stopping, 503 ``shutting_down`` (retryable: another gateway, or this one once it is back,
    takes it); an operator's stop past the drain, 409 ``deployment_stopped`` (not until it is
    started again); its engine's host lost, 502 ``engine_error`` (retryable: another instance
    may take it)."""
    if code == "shutting_down":
        return UnavailableError(why, code="shutting_down")
    if code == "deployment_stopped":
        return DeploymentStoppedError(why)
    return EngineError(why, retryable=True)


def _failure(ex: Exchange, exc: BaseException) -> BaseException:
    """The one mapping of a failed exchange to what the caller sees; notes how it ended."""
    out = ex.outcome
    out.ending, mapped = _mapped(ex, exc)
    return mapped


def _mapped(ex: Exchange, exc: BaseException) -> tuple[Ending, BaseException]:
    out = ex.outcome
    # A write to the client that failed (aiohttp's ClientConnectionResetError is a
    # ClientError too, though the engine's connection is not the one that broke).
    if isinstance(exc, ConnectionResetError) and (ex.writing or not isinstance(exc, _BROKEN)):
        return Ending.HANG_UP, ClientGoneError()
    if isinstance(exc, _NEVER_CONNECTED) and ex.response is None:
        out.sent = False
        return Ending.ENGINE_ERROR, NotAcceptedError(
            f"{ex.where} could not be reached", detail=str(exc)
        )
    if ex._aborted is not None:  # the gateway ended it: say so, not an engine failure
        out.error = ex._aborted
        return Ending.ENGINE_ERROR, ended_by_gateway(ex._abort_code, ex._aborted)
    if isinstance(exc, _BROKEN):
        out.error = str(exc) or type(exc).__name__
        return Ending.ENGINE_ERROR, EngineError(
            f"{ex.where}: the engine connection failed", detail=out.error
        )
    if isinstance(exc, TimeoutError) and ex._bound.expired:
        if ex.writing:
            return Ending.HANG_UP, ClientGoneError()
        if ex._started:
            what = "the engine stream was quiet for longer than queue.stream_idle_timeout"
            return Ending.IDLE_TIMEOUT, UnavailableError(what)
        return Ending.DEADLINE, UnavailableError("no output within queue.request_deadline")
    if isinstance(exc, asyncio.CancelledError):
        return Ending.HANG_UP, exc  # aiohttp cancels the handler when the client goes away
    if isinstance(exc, EngineRejectedError):
        out.answered = out.completed = True
        if isinstance(exc, EngineRefusalError):  # the engine's words: masked, then cut
            said = fit_for_client(exc.said, ex._headers, ex._url)
            return Ending.REFUSED, EngineRejectedError(exc.status, said)
        return Ending.REFUSED, exc
    if isinstance(exc, UnverifiedError):
        out.error = str(exc)
        if exc.detail:  # what the engine said, for the log: without its key, and short
            exc.detail = fit_for_log(exc.detail, ex._headers)[:MAX_DETAIL]
        return Ending.UNVERIFIED, exc
    if isinstance(exc, EngineError):  # a host's ingress that did not forward it included
        return Ending.ENGINE_ERROR, exc
    if isinstance(exc, GatewayError):
        return Ending.REFUSED, exc
    out.error = repr(exc)
    return Ending.ENGINE_ERROR, exc


def _finish(resp: Answer | None, clean: bool, drains: set[asyncio.Task[None]]) -> None:
    """The engine connection's fate: pooled after a whole answer, else closed (the close is
    what tells the engine to stop)."""
    if resp is None:
        return
    if not clean:
        resp.close()  # never back to the pool: the engine sees the close and stops
    elif resp.content.is_eof():
        resp.release()
    else:  # the answer is complete; wait for the body's end without holding it up
        task = running_loop().create_task(_release_when_ended(resp))
        drains.add(task)
        task.add_done_callback(drains.discard)


async def _release_when_ended(resp: Answer) -> None:
    """Pool the engine connection once its chunked body has ended after ``[DONE]``.

    uvicorn (vLLM, SGLang) writes that end on its own, after ``[DONE]``; a connection released
    before it arrives is closed rather than pooled, and the next request pays for a new one.
    Nothing but the end may come: more data, none within `DRAIN_S`, or a shutdown closes it.
    """
    ended = False
    try:
        with Deadline(running_loop().time() + DRAIN_S):
            ended = not await resp.content.readany() and resp.content.is_eof()
    except (TimeoutError, *_BROKEN):
        pass
    finally:
        if ended:
            resp.release()
        else:
            resp.close()
