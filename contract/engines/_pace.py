"""The time a long step has left, from the pace of its counted steps so far (pure: the caller
says what time it is)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from contract.engines._progress import Stage

__all__ = ["TimeLeft", "format_left"]


def format_left(seconds: float) -> str:
    """``under a minute left``, ``about 6 min left``."""
    return "under a minute left" if seconds < 60 else f"about {round(seconds / 60)} min left"


class TimeLeft:
    """The time a counted step still needs, from its pace so far: elapsed / fraction done.

    Counting starts at the first stage with a step count (the compile: what came before it says
    nothing of its pace) and starts again if the count goes back or its total changes. Nothing
    is said until the fraction done since then is at least ``min_fraction`` and the time at
    least ``min_elapsed_s``, nor outside a counted stage: a number nobody measured is left out,
    never shown as a guess.
    """

    def __init__(self, *, min_fraction: float = 0.05, min_elapsed_s: float = 20.0) -> None:
        self.min_fraction = min_fraction
        self.min_elapsed_s = min_elapsed_s
        self._since = 0.0  # when counting started, and the fraction and total it started at
        self._start_fraction = 0.0
        self._total: int | None = None
        self._fraction = 0.0
        self._counting = False

    def observe(self, stage: Stage, now: float) -> None:
        """Note where ``stage`` is, at ``now``."""
        if stage.done is None or not stage.total:
            self._counting = False
            return
        fraction = min(stage.done / stage.total, 1.0)
        if self._total != stage.total or fraction < self._fraction:
            self._since, self._start_fraction, self._total = now, fraction, stage.total
        self._fraction = fraction
        self._counting = True

    def seconds(self, now: float) -> float | None:
        """The seconds left at ``now``, or None while unmeasured."""
        if not self._counting:
            return None
        elapsed = now - self._since
        to_go = 1 - self._start_fraction
        made = (self._fraction - self._start_fraction) / to_go if to_go > 0 else 1.0
        if made < self.min_fraction or elapsed < self.min_elapsed_s:
            return None
        return elapsed * (1 - made) / made

    def text(self, now: float) -> str:
        """What to show at ``now``: ``about 6 min left``, or nothing."""
        seconds = self.seconds(now)
        return "" if seconds is None else format_left(seconds)
