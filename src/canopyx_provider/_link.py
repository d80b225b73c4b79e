"""The link to Canopy, as a small interface.

The hosted service's wire protocol is not specified in our documents, so none is invented here:
`CanopyLink` names what the connector exchanges with Canopy, and `InProcessLink` implements it in
memory for the tests and for ``canopyx-provider simulate``. Engine metrics never cross the link:
the messages below have no field that could carry them, only check status, prices, and decline
codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Self

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._pricing import CanopyCounts, Decline, Price, QuoteRequest
from ._snapshot import CheckReport

__all__ = [
    "CanopyLink",
    "CheckStatus",
    "ConnectionGrant",
    "InProcessLink",
    "LinkMessage",
    "PricePublication",
    "QuoteAnswer",
    "StatusReport",
]


@dataclass(frozen=True, slots=True)
class ConnectionGrant:
    """What Canopy hands the connector on each connection: the saved engine model ID."""

    engine_model_id: str


@dataclass(frozen=True, slots=True)
class CheckStatus:
    name: str
    ok: bool
    code: str | None
    """A fixed failure code (``unreachable``, ``missing_metric``...), never free text."""


@dataclass(frozen=True, slots=True)
class StatusReport:
    """The connector reporting in: which startup checks pass."""

    ready: bool
    checks: tuple[CheckStatus, ...]

    @classmethod
    def from_report(cls, report: CheckReport) -> StatusReport:
        return cls(
            ready=report.ok,
            checks=tuple(
                CheckStatus(c.name, c.ok, None if c.ok else (c.code or "failed"))
                for c in report.checks
            ),
        )


@dataclass(frozen=True, slots=True)
class PricePublication:
    model_id: str
    price: Price


@dataclass(frozen=True, slots=True)
class QuoteAnswer:
    request_id: str
    price: Price | None
    decline_code: str | None

    @classmethod
    def of(cls, request: QuoteRequest, outcome: Price | Decline) -> QuoteAnswer:
        if isinstance(outcome, Decline):
            return cls(request.request_id, None, outcome.code)
        # The amounts only: a price's detail stays on this machine, as a decline's does.
        return cls(request.request_id, Price(outcome.input_per_mtok, outcome.output_per_mtok), None)


LinkMessage = StatusReport | PricePublication | QuoteAnswer


class CanopyLink(Protocol):
    """What the connector exchanges with Canopy."""

    async def connect(self) -> ConnectionGrant: ...
    async def report(self, report: StatusReport) -> None: ...
    async def publish(self, publication: PricePublication) -> None: ...
    async def receive_quote(self) -> QuoteRequest:
        """Wait for Canopy's next quote request."""
        ...

    async def answer(self, answer: QuoteAnswer) -> None: ...
    def counts(self) -> CanopyCounts:
        """Canopy's own activity counts on this provider, as of now."""
        ...


class InProcessLink:
    """An in-memory Canopy: hands out a model ID, records everything sent, serves quotes."""

    def __init__(self, engine_model_id: str, *, counts: CanopyCounts | None = None) -> None:
        self.engine_model_id = engine_model_id
        self.sent: list[LinkMessage] = []
        self.current_counts = counts or CanopyCounts()
        send, receive = anyio.create_memory_object_stream[QuoteRequest](16)
        self._requests_in: MemoryObjectSendStream[QuoteRequest] = send
        self._requests_out: MemoryObjectReceiveStream[QuoteRequest] = receive
        self._waiters: dict[str, MemoryObjectSendStream[QuoteAnswer]] = {}
        self.reported = anyio.Event()
        """Set once the connector has reported in."""
        self.ready = anyio.Event()
        """Set once the connector has published a price."""

    async def connect(self) -> ConnectionGrant:
        return ConnectionGrant(self.engine_model_id)

    async def report(self, report: StatusReport) -> None:
        self.sent.append(report)
        self.reported.set()

    async def publish(self, publication: PricePublication) -> None:
        self.sent.append(publication)
        self.ready.set()

    async def receive_quote(self) -> QuoteRequest:
        return await self._requests_out.receive()

    async def answer(self, answer: QuoteAnswer) -> None:
        self.sent.append(answer)
        waiter = self._waiters.pop(answer.request_id, None)
        if waiter is not None:
            with waiter:
                await waiter.send(answer)

    def counts(self) -> CanopyCounts:
        return self.current_counts

    async def request_quote(self, request: QuoteRequest) -> QuoteAnswer:
        """Canopy's side: ask the connector for a quote and wait for its answer."""
        send, receive = anyio.create_memory_object_stream[QuoteAnswer](1)
        self._waiters[request.request_id] = send
        try:
            with receive:
                await self._requests_in.send(request)
                return await receive.receive()
        finally:
            self._waiters.pop(request.request_id, None)
            send.close()

    def close(self) -> None:
        """Close the quote channel; a pending `receive_quote` ends."""
        self._requests_in.close()
        self._requests_out.close()
        for waiter in self._waiters.values():
            waiter.close()
        self._waiters.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
