"""What each request adds to the gateway's own counts and timings (`Telemetry`), once it is
answered or its client has gone: its outcome, the code it was refused with, and the timings of
its phases, all counted from its arrival."""

from __future__ import annotations

from .._errors import BusyError, EngineError, GatewayError, RefusedError
from .._loop import running_loop
from .._relay.exchange import Exchange
from .._telemetry import Telemetry

__all__ = ["Times", "outcome_of", "record"]


class Times:
    """Loop times of one request's milestones before it reaches an engine."""

    __slots__ = ("arrival", "ready", "slot")

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.slot: float | None = None
        self.ready: float | None = None


def outcome_of(ex: Exchange | None, err: GatewayError | None) -> str:
    """completed, engine_error, unverified, hang_up, deadline, idle_timeout or refused."""
    if ex is None:
        if err is None:
            return "completed"
        return "refused" if isinstance(err, RefusedError | BusyError) else "engine_error"
    out = ex.outcome
    if out.cut is not None:
        return out.cut
    if out.kind == "engine_rejected":
        return "refused"
    if out.kind is not None:
        return out.kind
    if err is not None:
        return "engine_error" if isinstance(err, EngineError) else "refused"
    return "completed"


def record(
    t: Telemetry,
    deployment: str,
    api: str,
    outcome: str,
    code: str | None,
    times: Times,
    ex: Exchange | None,
    instance: int | None,
    launched: bool,
) -> None:
    t.requests[(deployment, api, outcome)] += 1
    if outcome == "refused" and code is not None:
        t.refusals[(deployment, code)] += 1
    if not deployment:
        return
    arrival = times.arrival
    queue, activation, head, content, last, total = t.phases(
        deployment, "" if instance is None else _INDEX.get(instance) or str(instance)
    )
    if times.slot is not None:
        queue.observe(times.slot - arrival)
        if launched and times.ready is not None:
            activation.observe(times.ready - times.slot)
    if ex is not None:
        out = ex.outcome
        if out.head_at is not None:
            head.observe(out.head_at - arrival)
        if out.first_content_at is not None:
            content.observe(out.first_content_at - arrival)
        if out.last_at is not None:
            last.observe(out.last_at - arrival)
    total.observe(running_loop().time() - arrival)


_INDEX = {i: str(i) for i in range(64)}
