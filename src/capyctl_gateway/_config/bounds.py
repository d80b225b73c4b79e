"""The bounds of what the gateway serves: its queue (`QueueConfig`) and the sizes, times and
connections it accepts (`Limits`)."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, Field, model_validator
from pydantic.config import JsonDict

from .parts import KEEPALIVE_TIMEOUT_S, STRICT, ConfigError, Seconds

__all__ = ["SHARED", "Limits", "QueueConfig", "fit_workers", "shared_bounds"]

SHARED: JsonDict = {"per_process": "shared"}
"""The marker of a bound of the whole gateway that its worker processes share (each holds its
part: ``serve --workers``); a bound without it holds in each process as configured."""


class QueueConfig(BaseModel):
    model_config = STRICT

    request_deadline: Seconds = 600.0
    """First output must arrive within this, counted from arrival (waiting included)."""
    stream_idle_timeout: Seconds = 120.0
    """Longest quiet gap once output has started."""
    connect_timeout: Seconds = 10.0
    """Opening a connection to an engine may take this long; past it the engine never got the
    request, and the next instance is offered it."""
    max_running_per_deployment: int = Field(default=32, ge=1, le=4096)
    max_waiting_per_deployment: int = Field(default=64, ge=0, le=4096)
    max_waiting_total: int = Field(default=256, ge=0, le=65536)


class Limits(BaseModel):
    model_config = STRICT

    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Chat request bodies above this are refused with 413."""
    max_decision_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    """Decision request bodies above this are refused with 413."""
    max_body_bytes_in_flight: int = Field(
        default=256 * 1024 * 1024, ge=1024, json_schema_extra=SHARED
    )
    """Request bodies being read and held, over all requests at once; a body that would pass
    it is refused with 503 (retryable). With workers, each holds an equal share, and a share
    holds at least the largest body a request may have (`fit_workers`)."""
    max_body_bytes_per_client: int | None = Field(default=None, ge=1024)
    """What one client (an address; an IPv6 /64) may hold of the body budget, in each process;
    a body that would pass it is refused with 503 (retryable). Left unset: half the process's
    budget, and at least the largest body a request may have (`client_share`)."""
    max_json_tokens: int = Field(default=1_000_000, ge=1000, le=100_000_000)
    """A body with more of ``,`` ``:`` ``[`` ``{`` than this (an upper bound of its JSON values,
    counted in strings too) is refused with 413 before it is parsed: the work and the memory
    a body's parse costs grow with its values, not its bytes."""
    body_read_timeout: Seconds = 120.0
    """A request body must have arrived whole within this (408 past it)."""
    header_timeout: Seconds = 10.0
    """A connection's request head must arrive within this; else it is closed."""
    keepalive_timeout: Seconds = KEEPALIVE_TIMEOUT_S
    """A keep-alive connection idle this long after an answer is closed (every listener)."""
    max_connections: int = Field(default=2048, ge=1, le=1_000_000, json_schema_extra=SHARED)
    """Client connections held at once; past it a connection gets a 503 and is closed."""
    shutdown_timeout: Seconds = 60.0
    """A stopping gateway waits this long for running requests, then ends them in band."""
    max_answer_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """An engine answer the gateway assembles or reads whole (non-streamed chat, decisions)
    may be this large; past it, 502 engine_error."""

    @property
    def largest_body(self) -> int:
        """The largest body a request may have, of either API."""
        return max(self.max_body_bytes, self.max_decision_body_bytes)

    @property
    def client_share(self) -> int:
        """What one client may hold of this process's body budget."""
        if self.max_body_bytes_per_client is not None:
            return self.max_body_bytes_per_client
        return max(self.largest_body, self.max_body_bytes_in_flight // 2)

    @model_validator(mode="after")
    def _a_body_fits_the_budget(self) -> Self:
        """A body within the per-request limits must fit the budget, or it would be refused
        for ever with a 503 that says to retry: the default grows to hold the largest one; a
        budget set smaller is refused."""
        largest = self.largest_body
        if self.max_body_bytes_in_flight < largest:
            if "max_body_bytes_in_flight" in self.model_fields_set:
                raise ValueError(
                    f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) is less than "
                    f"the largest body a request may have ({largest}: max_body_bytes or "
                    "max_decision_body_bytes), which could never be read: raise it or lower those"
                )
            object.__setattr__(self, "max_body_bytes_in_flight", largest)  # not set: a default
        share = self.max_body_bytes_per_client
        if share is not None and share < largest:
            raise ValueError(
                f"max_body_bytes_per_client ({share}) is less than the largest body a request "
                f"may have ({largest}: max_body_bytes or max_decision_body_bytes), which could "
                "never be read: raise it or lower those"
            )
        return self


def shared_bounds(model: type[BaseModel]) -> tuple[str, ...]:
    """The fields of ``model`` marked `SHARED`: what each of N workers holds a part of."""
    return tuple(name for name, f in model.model_fields.items() if f.json_schema_extra == SHARED)


def fit_workers(limits: Limits, workers: int) -> Limits:
    """``limits`` for a gateway of ``workers`` processes, each holding an equal share of the
    body budget (rounded up). A share smaller than the largest body a request may have would
    refuse such a request for ever, with a 503 that says to retry: left at its default, the
    budget grows to ``workers`` times that body; set in the configuration, it is refused."""
    largest, total = limits.largest_body, limits.max_body_bytes_in_flight
    if -(-total // workers) >= largest:  # one process: the validator made it so
        return limits
    if "max_body_bytes_in_flight" in limits.model_fields_set:
        raise ConfigError(
            f"limits.max_body_bytes_in_flight ({total} bytes) split over {workers} workers "
            f"leaves each less than the largest body a request may have ({largest} bytes, "
            "limits.max_body_bytes or max_decision_body_bytes), which would be refused for "
            f"ever: set it to at least {workers * largest}, lower those limits, or run fewer "
            "workers"
        )
    return limits.model_copy(update={"max_body_bytes_in_flight": workers * largest})
