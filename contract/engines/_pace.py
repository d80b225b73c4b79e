"""The time a long step has left, from the pace of its counted steps so far (pure: the caller
says what time it is).

A count of steps is a poor measure of a build's progress: llama.cpp's first 200 of 336 steps
(ggml's small C files) take a third of its time, the last ones (the server's and the chat
templates' C++) take seconds each. Where the time each step took in a measured build is known
(:func:`read_step_times`), the fraction done is the share of that time behind it, so the pace
measured on the first steps says how long the heavy ones will take.
"""

from __future__ import annotations

from statistics import fmean
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from contract.engines._progress import Stage

__all__ = ["StepTimes", "TimeLeft", "format_left", "read_step_times"]


def format_left(seconds: float) -> str:
    """``under a minute left``, ``about 6 min left``."""
    return "under a minute left" if seconds < 60 else f"about {round(seconds / 60)} min left"


class StepTimes:
    """What each step of a measured build took: its seconds by each output it made (the name
    a build's status line ends with), and the build's whole count and time."""

    def __init__(self, steps: Mapping[tuple[str, ...], float]) -> None:
        if not steps:
            raise ValueError("no steps")
        self.count = len(steps)
        self.total_s = sum(steps.values())
        self.mean_s = fmean(steps.values())
        self._by_output = {out: s for outputs, s in steps.items() for out in outputs}

    def __contains__(self, output: object) -> bool:
        return output in self._by_output

    def seconds(self, output: str) -> float:
        """The step's time, or the mean of all steps for one the measured build had not."""
        return self._by_output.get(output, self.mean_s)

    def total(self, count: int) -> float:
        """The time of a build of ``count`` steps: the measured one's, scaled to its count."""
        return self.total_s if count == self.count else self.total_s * count / self.count


def read_step_times(text: str) -> StepTimes:
    """A build's step times from lines of ``milliseconds<TAB>output output ...`` (``#`` starts
    a comment): one line per step, as a ``.ninja_log`` gives them (end minus start)."""
    steps: dict[tuple[str, ...], float] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        ms, _, outputs = line.partition("\t")
        steps[tuple(outputs.split())] = int(ms) / 1000
    return StepTimes(steps)


class TimeLeft:
    """The time a counted step still needs, from its pace so far: elapsed / fraction done.

    The fraction done is the share of the measured build's time (``times``) behind it where
    the stages name their step's output, else the share of the steps. Counting starts at the
    first stage with a step count (the compile: what came before it says nothing of its pace)
    and starts again if the count goes back or its total changes. Nothing is said until the
    fraction done since then is at least ``min_fraction`` and the time at least
    ``min_elapsed_s``, nor outside a counted stage: a number nobody measured is left out,
    never shown as a guess.
    """

    def __init__(
        self,
        *,
        times: StepTimes | None = None,
        min_fraction: float = 0.05,
        min_elapsed_s: float = 20.0,
    ) -> None:
        self.times = times
        self.min_fraction = min_fraction
        self.min_elapsed_s = min_elapsed_s
        self._since = 0.0  # when counting started, and the fraction and total it started at
        self._start_fraction = 0.0
        self._total: int | None = None
        self._done = 0
        self._weight = 0.0  # the measured seconds of the steps done
        self._fraction = 0.0
        self._counting = False

    def _fraction_at(self, stage: Stage, restart: bool) -> float:
        assert stage.done is not None and stage.total
        if self.times is None or not stage.unit:
            return min(stage.done / stage.total, 1.0)
        if restart:  # the steps done before this one: their mean, as nothing named them
            self._weight = max(stage.done - 1, 0) * self.times.mean_s
            self._done = max(stage.done - 1, 0)
        # Each status line says one step ended; any the count skipped weigh the mean.
        skipped = max(stage.done - self._done - 1, 0)
        if stage.done > self._done:
            self._weight += skipped * self.times.mean_s + self.times.seconds(stage.unit)
        return min(self._weight / self.times.total(stage.total), 1.0)

    def observe(self, stage: Stage, now: float) -> None:
        """Note where ``stage`` is, at ``now``."""
        if stage.done is None or not stage.total:
            self._counting = False
            return
        restart = self._total != stage.total or stage.done < self._done
        fraction = self._fraction_at(stage, restart)
        if restart or fraction < self._fraction:
            self._since, self._start_fraction, self._total = now, fraction, stage.total
        self._fraction = fraction
        self._done = stage.done
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
