"""The connector: Canopy's link, one engine's collector and a pricing strategy, together."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import anyio
import httpx

from ._collector import Collector, EngineStatus
from ._events import ChecksCompleted, Event, EventHook, ScrapeFailed
from ._link import CanopyLink, PricePublication, QuoteAnswer, StatusReport
from ._options import ProviderOptions
from ._pricing import Decline, Price, PricingStrategy, QuoteContext, QuoteRequest
from ._snapshot import CheckReport
from .adapters import EngineAdapter

__all__ = ["Provider"]

logger = logging.getLogger(__name__)
ENGINE = "engine"
QUOTE_TIMEOUT = "quote_timeout"
"""The decline code of a quote whose callback did not answer within ``request_timeout_ms``."""


class Provider:
    """Connects to Canopy, checks the engine, publishes prices and answers quotes.

    On each connection it receives the engine model ID, runs the startup checks (health, model
    discovery and, for engines that publish load, metrics validation) until they pass, reports
    in, publishes the strategy's list price and then answers quote requests from the latest
    snapshot. Quote callbacks never wait on the engine.
    """

    def __init__(
        self,
        adapter: EngineAdapter,
        strategy: PricingStrategy,
        link: CanopyLink,
        *,
        options: ProviderOptions | None = None,
        client: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.time,
        hooks: Sequence[EventHook] = (),
    ) -> None:
        self.adapter = adapter
        self.strategy = strategy
        self.link = link
        self.options = options or ProviderOptions()
        self._clock = clock
        self.collector = Collector(
            options=self.options, client=client, clock=clock, hooks=(*hooks, self._heard)
        )
        self.model_id: str | None = None
        self._reported: StatusReport | None = None
        self._changed: anyio.Event | None = None
        """Set by the collector's events once serving: the checks' status may have changed."""

    async def run(self) -> None:
        """Serve until cancelled."""
        grant = await self.link.connect()
        self.model_id = grant.engine_model_id
        async with self.collector, anyio.create_task_group() as tg:
            self.collector.add(ENGINE, self.adapter, model_id=grant.engine_model_id, poll=False)
            report = await self._until_ready()
            logger.info("engine ready: %s %s", self.adapter.kind.value, report.engine_version)
            self._changed = anyio.Event()
            tg.start_soon(self._report_changes)
            self.collector.start_polling(ENGINE)  # from here on, on its own schedule
            await self.link.publish(
                PricePublication(grant.engine_model_id, self.strategy.list_price)
            )
            while True:
                request = await self.link.receive_quote()
                await self.link.answer(QuoteAnswer.of(request, await self.quote(request)))

    async def _until_ready(self) -> CheckReport:
        while True:
            report = await self.collector.check(ENGINE)
            self._reported = StatusReport.from_report(report)
            await self.link.report(self._reported)
            if report.ok:
                return report
            await anyio.sleep(self.options.poll_interval_s)

    def _heard(self, event: Event) -> None:
        """The collector's hook (no I/O): a poll failed or the checks ran again."""
        if isinstance(event, ScrapeFailed | ChecksCompleted) and self._changed is not None:
            self._changed.set()

    async def _report_changes(self) -> None:
        """While serving, report each change of the checks' status (a poll that fails, the
        checks that run after it, their passing again), so that Canopy shows which check
        failed; changes faster than a report is sent go as the latest status."""
        while True:
            assert self._changed is not None
            await self._changed.wait()
            self._changed = anyio.Event()
            checks = self.collector.status(ENGINE).checks
            report = StatusReport.from_report(CheckReport(checks=checks))
            if report != self._reported:
                self._reported = report
                await self.link.report(report)

    def context(self) -> QuoteContext:
        """What a quote callback sees now: no I/O."""
        snap = self.collector.snapshot(ENGINE)
        return QuoteContext(
            engine=self.adapter.kind,
            support=self.adapter.support,
            metrics=snap.metrics if snap is not None else None,
            collected_at=snap.collected_at if snap is not None else None,
            capacity=self.collector.capacity(ENGINE),
            counts=self.link.counts(),
        )

    async def quote(self, request: QuoteRequest) -> Price | Decline:
        """The strategy's answer to ``request``, or a decline if it takes longer than
        ``request_timeout_ms``.

        An async callback still running at the deadline is cancelled. A plain callback cannot be
        interrupted: it holds up the connector until it returns, and its late answer is then
        replaced by the decline.
        """
        timeout_s = self.options.request_timeout_s
        start = anyio.current_time()
        outcome: Price | Decline | None = None
        with anyio.move_on_after(timeout_s) as scope:
            answer = self.strategy.quote(request, self.context())
            outcome = answer if isinstance(answer, Price | Decline) else await answer
        # Late is late, even for a callback that swallowed its cancellation and answered.
        if outcome is None or scope.cancel_called or anyio.current_time() - start > timeout_s:
            return self._timed_out(request)
        return outcome

    def _timed_out(self, request: QuoteRequest) -> Decline:
        ms = self.options.request_timeout_ms
        # The request ID only: a request's other fields and the strategy's state stay out of logs.
        logger.warning(
            "quote %s declined (%s): the pricing callback took longer than %d ms",
            request.request_id,
            QUOTE_TIMEOUT,
            ms,
        )
        return Decline(QUOTE_TIMEOUT, f"the pricing callback took longer than {ms} ms")

    def overview(self) -> EngineStatus:
        """Which check passed or failed, and the latest snapshot."""
        return self.collector.status(ENGINE)
