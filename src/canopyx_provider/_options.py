"""The provider's collection options."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ProviderOptions"]


class ProviderOptions(BaseModel):
    """How often and how patiently the collector talks to engines.

    A snapshot older than ``max_metrics_age_ms`` is unusable: callbacks then see no metrics.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    poll_interval_ms: int = Field(default=1000, gt=0)
    """Delay between collection cycles."""
    request_timeout_ms: int = Field(default=3000, gt=0)
    """Bound on one collection cycle, and on each quote callback (a late quote is declined)."""
    max_metrics_age_ms: int = Field(default=5000, gt=0)
    """Maximum age of a usable snapshot."""
    connect_attempts: int = Field(default=3, ge=1, le=10)
    """Tries per startup check against an engine that is unreachable or slow (tenacity)."""

    @property
    def poll_interval_s(self) -> float:
        return self.poll_interval_ms / 1000

    @property
    def request_timeout_s(self) -> float:
        return self.request_timeout_ms / 1000

    @property
    def max_metrics_age_s(self) -> float:
        return self.max_metrics_age_ms / 1000
