"""TensorFold 0.6.x, for the gateway: its ``/health`` carries the load signal."""

from __future__ import annotations

from .._errors import SnapshotValidationError
from .._scrape import Fetcher, RawResponse
from .._snapshot import EngineKind, EngineMetrics, SupportLevel
from ._base import Discovery, EngineAdapter, Poll, expect_status, int_or_none, json_object

__all__ = ["TensorFoldAdapter"]


class TensorFoldAdapter(EngineAdapter):
    """Reads ``requests_running`` and ``busy`` from TensorFold's ``/health``.

    TensorFold leaves them out when the server has API keys configured: such a server cannot
    be collected from, and validation says why instead of guessing an idle engine.
    """

    kind = EngineKind.TENSORFOLD
    support = SupportLevel.HEALTH_LOAD

    async def collect(
        self, fetch: Fetcher, model_id: str, discovery: Discovery, health: RawResponse
    ) -> Poll:
        return self.parse_health_load(health)

    def parse_health(self, resp: RawResponse) -> None:
        expect_status(resp, 200, what="health")

    def parse_health_load(self, resp: RawResponse) -> Poll:
        doc = json_object(resp, what="health")
        running, busy = int_or_none(doc.get("requests_running")), doc.get("busy")
        if running is None or running < 0 or not isinstance(busy, bool):
            raise SnapshotValidationError(
                f"{resp.url} carries no requests_running/busy: TensorFold omits them when API "
                "keys are configured, so this server publishes no load",
                metric="requests_running",
            )
        return Poll(
            EngineMetrics(
                running_requests=running,
                busy=busy,
                prompt_tokens_total=_number(doc.get("prompt_tokens_total")),
                generated_tokens_total=_number(doc.get("completion_tokens_total")),
            )
        )


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
