"""The bounds of what the gateway serves: its queue (`QueueConfig`) and the sizes, times and
connections it accepts (`Limits`)."""

from __future__ import annotations

from pydantic import BaseModel, Field
from pydantic.config import JsonDict

from .parts import KEEPALIVE_TIMEOUT_S, STRICT, Seconds

__all__ = ["SHARED", "Limits", "QueueConfig", "shared_bounds"]

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
    it is refused with 503 (retryable)."""
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


def shared_bounds(model: type[BaseModel]) -> tuple[str, ...]:
    """The fields of ``model`` marked `SHARED`: what each of N workers holds a part of."""
    return tuple(name for name, f in model.model_fields.items() if f.json_schema_extra == SHARED)
