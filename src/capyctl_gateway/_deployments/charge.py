"""A request charged to the instance it was offered to (a context manager: nothing in it waits).

While it runs there it counts in the instance's in-flight requests and its runner tracks its
exchange (a host that goes away ends it). When it ends cut short (sent, and not ended on the
engine's terms) it stays charged as a cut request until `Settlement` proves the engine
stopped it.
"""

from __future__ import annotations

from types import TracebackType
from typing import Protocol

from .. import _clock
from .routes import EngineInstance
from .runner import Tracked
from .settle import Settlement

__all__ = ["Charge"]


class _Ended(Protocol):
    @property
    def sent(self) -> bool: ...

    @property
    def completed(self) -> bool: ...

    @property
    def answered(self) -> bool: ...

    @property
    def cut(self) -> str | None: ...


class _Exchange(Tracked, Protocol):
    @property
    def outcome(self) -> _Ended: ...


class Charge:
    """``with Charge(...)``: request ``rid``'s exchange ``ex`` with ``inst``."""

    __slots__ = ("_began", "_ex", "_inst", "_rid", "_settlement")

    def __init__(
        self, inst: EngineInstance, ex: _Exchange, rid: str, settlement: Settlement
    ) -> None:
        self._inst, self._ex, self._rid, self._settlement = inst, ex, rid, settlement

    def __enter__(self) -> None:
        inst = self._inst
        if inst.timed:
            self._began = _clock.now()
        inst.ledger.running += 1
        inst.inflight.add(self._ex)
        inst.runner.begin(self._ex)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        inst, out = self._inst, self._ex.outcome
        inst.runner.end(self._ex)
        inst.inflight.discard(self._ex)
        inst.ledger.running -= 1
        if inst.timed:
            ended = _clock.now()
            inst.ledger.ended(ended - self._began if out.completed else None, ended)
        if out.sent and not out.completed:  # it may still run on the engine
            reason = out.cut or "engine stream broken"
            self._settlement.cut(inst.ledger, self._rid, answered=out.answered, reason=reason)
