"""What an instance's samples prove of its engine's restarts: the evidence that settles a
request cut before the engine's first token (`settle`)."""

from __future__ import annotations

from dataclasses import dataclass

from canopyx_provider import EngineSnapshot

__all__ = ["ABSENCE_S", "Restart"]

ABSENCE_S = 3.0
"""The collector's timeout of one request (the default of `ProviderOptions`; the fleet passes
its own): an engine whose health failed for longer than this, before it answered again, was
away (a restart), not slow."""
_COUNTERS = (
    "prompt_tokens_total",
    "generated_tokens_total",
    "prefix_cache_queried_tokens_total",
    "prefix_cache_hit_tokens_total",
)


@dataclass(eq=False)
class Restart:
    """What an instance's samples prove of its engine's restarts (a new start marker comes as
    its own event): a cumulative counter that went down since the sample before, or a
    health check failing for longer than a poll's timeout before a sample came again.

    Where the engine publishes a start marker (vLLM, llama.cpp, SGLang), the marker is the
    proof: the same marker after an absence is the same process back from a stall (a long
    prefill can hold a health check past its timeout), and what it was cut from may still run.
    """

    down_since: float | None = None
    """When its health check started failing (None while it answers)."""
    counters: tuple[float | None, ...] = ()
    sampled_at: float | None = None
    marker: float | None = None
    """The start marker of the sample before (None: the engine publishes none)."""

    def down(self, at: float) -> None:
        if self.down_since is None:
            self.down_since = at

    def sampled(self, snap: EngineSnapshot, absence_s: float) -> tuple[float, str] | None:
        """What ``snap`` proves: the time the restart came after and the evidence; or None."""
        m = snap.metrics
        counters = tuple(getattr(m, name) for name in _COUNTERS)
        before, self.counters = self.counters, counters
        down, self.down_since = self.down_since, None
        last, self.sampled_at = self.sampled_at, snap.requested_at
        marker, self.marker = self.marker, snap.process_start
        same_process = marker is not None and marker == snap.process_start
        if down is not None and snap.requested_at - down > absence_s and not same_process:
            return down, "engine back after an absence"
        went_down = [
            n
            for n, a, b in zip(_COUNTERS, before, counters, strict=False)
            if a is not None and b is not None and b < a
        ]
        if went_down and last is not None:
            return last, f"engine restarted ({went_down[0]} went down)"
        return None
