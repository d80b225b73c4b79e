"""``canopyx-provider simulate``'s traffic: synthetic quote requests sent through an in-process
link to a running `Provider`, and a table of what its strategy answered beside the engine's load
as the latest snapshot had it."""

from __future__ import annotations

import anyio
from rich.console import Console
from rich.table import Table

from ._link import InProcessLink, StatusReport
from ._pricing import CanopyCounts, QuoteRequest
from ._provider import Provider
from ._snapshot import EngineMetrics

__all__ = ["quote_table", "started"]


async def started(console: Console, link: InProcessLink, provider: Provider) -> bool:
    """Whether the provider's first report says its startup checks passed; if not, what failed
    is printed."""
    await link.reported.wait()
    first = next(m for m in link.sent if isinstance(m, StatusReport))
    if first.ready:
        return True
    for c in first.checks:
        console.print(f"{c.name}: {'ok' if c.ok else c.code}")
    console.print(f"[red]startup checks failed[/red]: {provider.overview().error}")
    return False


async def quote_table(
    link: InProcessLink, provider: Provider, model: str, *, quotes: int, rate: float
) -> Table:
    """Send ``quotes`` synthetic quote requests, ``rate`` a second; a row per answer."""
    table = Table("#", "canopy active", "pending", "engine load", "answer")
    for i in range(quotes):
        link.current_counts = CanopyCounts(active_requests=i % 4, pending_quotes=i % 3)
        request = QuoteRequest(f"q{i}", model, prompt_tokens=512, max_output_tokens=256)
        answer = await link.request_quote(request)
        load = _load_summary(provider.context().metrics)
        shown = (
            f"decline ({answer.decline_code})"
            if answer.price is None
            else f"{answer.price.input_per_mtok} / {answer.price.output_per_mtok} $/Mtok"
        )
        table.add_row(str(i), str(i % 4), str(i % 3), load, shown)
        await anyio.sleep(1 / rate)
    return table


def _load_summary(m: EngineMetrics | None) -> str:
    if m is None:
        return "no fresh snapshot"
    if not m.has_engine_load:
        return "not published"
    parts = [f"running {m.running_requests}"]
    if m.waiting_requests is not None:
        parts.append(f"waiting {m.waiting_requests}")
    for name, ratio in (("KV", m.kv_cache_usage_ratio), ("slots", m.slot_usage_ratio)):
        if ratio is not None:
            parts.append(f"{name} {ratio:.0%}")
    return ", ".join(parts)
