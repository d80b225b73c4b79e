"""What each request adds to the gateway's own counts and timings (`Telemetry`), once it is
answered or its client has gone: its outcome, the code it was refused with, and the timings of
its phases, all counted from its arrival; and its deployment's recent window (the console's
requests, errors, the answers' time to first token and the waits for a start or wake).

A `Tally` is filled in as the request goes (the public handlers, placing, the exchange);
`figures` turns it into plain values (`Figures`, what a worker sends its authority) and `add`
counts them. Never imports the HTTP surface, the lifecycle or management.
"""

from __future__ import annotations

from typing import NamedTuple

from . import _clock
from ._errors import EngineError, GatewayError
from ._loop import running_loop
from ._relay.exchange import Exchange
from ._telemetry import Ending, Telemetry

__all__ = ["Figures", "Tally", "add", "ending_of", "failed", "record"]


class Tally:
    """One request as the gateway's counts see it, filled in as it goes: its deployment, the
    loop times of its milestones before an engine, how it ended, the code it was refused
    with and its status, and its last exchange and instance."""

    __slots__ = (
        "api",
        "arrival",
        "code",
        "deployment",
        "ending",
        "ex",
        "gated",
        "instance",
        "launched",
        "slot",
        "status",
    )

    def __init__(self, api: str, arrival: float) -> None:
        self.api = api
        self.arrival = arrival
        self.deployment = ""
        """Known once the body names one (refusals before that count under "")."""
        self.slot: float | None = None
        self.gated = False
        """A launched deployment that served no request when it arrived: its wait for a slot
        was a wait for a start or wake."""
        self.ending = Ending.HANG_UP
        """What a cancellation leaves (a client that hung up); set on every other way out."""
        self.code: str | None = None
        self.status: int | None = None
        """The status of the error it was answered with, if any."""
        self.ex: Exchange | None = None
        self.instance: int | None = None
        self.launched = False

    def ended(self, err: GatewayError | None = None) -> None:
        """The request was answered: with ``err``, or as its exchange ended."""
        self.ending = ending_of(self.ex, err)
        if err is not None:
            self.code, self.status = err.code, err.status

    def figures(self) -> Figures:
        """this request's counts, the times taken now (its end) and made relative to its arrival."""
        arrival = self.arrival
        slot = activation = head = content = last = ttft = None
        if self.slot is not None:
            slot = self.slot - arrival
            if self.launched:
                activation = slot if self.gated else 0.0
        ex = self.ex
        if ex is not None:
            out = ex.outcome
            if out.head_at is not None:
                head = out.head_at - arrival
            if out.first_content_at is not None:
                content = out.first_content_at - arrival
            if out.last_at is not None:
                last = out.last_at - arrival
            ttft = out.ttft
        total = _clock.now() - arrival
        # Made as a tuple is, without the NamedTuple's own __new__ (a Python frame): about
        # 2,500 instructions less, once a request.
        return _new_figures(
            Figures,
            (
                self.deployment,
                self.api,
                _VALUES[self.ending],  # its value, without the enum's descriptor
                self.code,
                self.status,
                self.instance,
                slot,
                activation,
                head,
                content,
                last,
                total,
                ttft,
            ),
        )


def ending_of(ex: Exchange | None, err: GatewayError | None) -> Ending:
    """How a request ended: as its last exchange ended, when it had one; otherwise (refused
    before any engine saw it, or no instance could take it) by the error it was answered."""
    if ex is not None and ex.outcome.ending is not None:
        return ex.outcome.ending
    if err is None:
        return Ending.COMPLETED
    return Ending.ENGINE_ERROR if isinstance(err, EngineError) else Ending.REFUSED


class Figures(NamedTuple):
    """One request's counts as plain values (what a worker sends its authority): the seconds
    are counted from its arrival."""

    deployment: str
    api: str
    ending: str
    code: str | None
    """The code it was refused with."""
    status: int | None
    instance: int | None
    slot: float | None
    """To its running slot."""
    activation: float | None
    """The part of that spent waiting for a start or wake (0 when none was needed)."""
    head: float | None
    """To the engine's answer's head."""
    content: float | None
    """To the first content."""
    last: float | None
    """To the last chunk."""
    total: float
    """To its end."""
    ttft: float | None
    """The time to first token its answer reported (its ``ttft_ms``): from when the engine
    was asked, the wait for a slot and for a start or wake left out."""


_new_figures = tuple.__new__


def record(t: Telemetry, r: Tally) -> None:
    add(t, r.figures(), running_loop().time())


def add(t: Telemetry, f: Figures, now: float) -> None:
    """Count one request's figures (``now``: the loop time of its end, for its window)."""
    (
        deployment,
        api,
        ending,
        code,
        status,
        instance,
        slot,
        activation,
        head,
        content,
        last,
        end,
        ttft,
    ) = f
    outcome = _ENDINGS.get(ending) or Ending(ending)  # (the enum's call: a Python frame)
    t.requests[(deployment, api, outcome)] += 1
    if outcome is Ending.REFUSED and code is not None:
        t.refusals[(deployment, code)] += 1
    if not deployment:
        return
    queue, activation_, head_, content_, last_, total = t.phases(
        deployment, "" if instance is None else _INDEX.get(instance) or str(instance)
    )
    if slot is not None:
        queue.observe(slot)
    if activation is not None:
        activation_.observe(activation)
    if head is not None:
        head_.observe(head)
    if content is not None:
        content_.observe(content)
    if last is not None:
        last_.observe(last)
    total.observe(end)
    wake = activation if activation else None  # a wait for a start or wake, apart
    t.window(deployment, now).add(now, failed(outcome, status), ttft, wake)


def failed(ending: Ending, status: int | None) -> bool:
    """Whether the console's recent window counts a request that ended so as an error: what
    the gateway or the engine failed at (an engine error, an unverified stream, a deadline or
    an idle timeout, a refusal answered 5xx, or 429 ``queue_full``: it could not take it), not
    a client's mistake (any other 4xx refusal, the engine's ``engine_rejected`` included) nor
    a client that hung up."""
    if ending is Ending.REFUSED:
        return status is not None and (status >= 500 or status == 429)
    return ending not in _FINE


_FINE = frozenset({Ending.COMPLETED, Ending.HANG_UP})


_INDEX = {i: str(i) for i in range(64)}
_ENDINGS = {e.value: e for e in Ending}
_VALUES = {e: e.value for e in Ending}
