"""The chat stream's usage as the Response's (pure).

OpenAI's schema requires every count of a Response's ``usage``. Each is the engine's own count,
or a count known exactly without one: no reasoning text streamed is 0 reasoning tokens, and
``cache_write_tokens`` (input written to a prompt cache kept for a retention OpenAI bills) is 0,
as the engines keep no such cache (what their prefix caches serve again is ``cached_tokens``).
A count that is neither (cached tokens an engine did not report; reasoning tokens it did not
count for reasoning it streamed) is never made up: ``usage`` is then left out.
"""

from __future__ import annotations

from typing import Any

from .._relay.figures import Figures, num

__all__ = ["usage_of"]


def usage_of(
    usage: dict[str, Any] | None, figures: Figures, *, reasoned: bool
) -> dict[str, Any] | None:
    """The Response's ``usage`` from the engine's and the answer's ``cached_tokens`` figure
    (which reads each engine's own count); None where a count is not known (see above)."""
    if not usage:
        return None
    given, made = num(usage.get("prompt_tokens")), num(usage.get("completion_tokens"))
    cached = figures.get("cached_tokens", {}).get("value")
    details = usage.get("completion_tokens_details")
    reasoning = num(details.get("reasoning_tokens")) if isinstance(details, dict) else None
    if reasoning is None and not reasoned:
        reasoning = 0
    if given is None or made is None or cached is None or reasoning is None:
        return None
    total = num(usage.get("total_tokens"))
    return {
        "input_tokens": given,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": made,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": given + made if total is None else total,
    }
