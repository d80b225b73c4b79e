"""SGLang with ``--enable-metrics``; contract target v0.5.21 (recorded from its sources)."""

from __future__ import annotations

from collections.abc import Mapping

from .._errors import InfoParseError, MissingMetricError, SnapshotValidationError
from .._prom import Sample, finite, parse_samples, select_one
from .._scrape import Fetcher, RawResponse
from .._snapshot import Capacity, EngineKind, EngineMetrics, SupportLevel
from ._base import Discovery, ModelLabelledAdapter, Poll, expect_status, int_or_none, json_object

__all__ = ["SglangAdapter"]

RUNNING, WAITING, TOKEN_USAGE = "num_running_reqs", "num_queue_reqs", "token_usage"
PROMPT, CACHED = "prompt_tokens_total", "cached_tokens_total"
_GAUGES = (RUNNING, WAITING, TOKEN_USAGE)
_NAMES = (*_GAUGES, PROMPT, CACHED)
# SGLang's token counters come from its tokenizer process, split by ``is_streaming`` (and the
# cached tokens by ``cache_source``) and without the scheduler labels: prompt_tokens_total and
# generated_tokens_total stay None rather than summed. Its prefix cache's counts are read as
# prompt tokens looked up and found (see `_prefix_counts`): counted when a request finishes.
# SGLang itself writes "sglang:"; its model gateway's aggregator (and name-normalising
# pipelines) rewrite it to "sglang_". Either is accepted, never both for one model.
PREFIXES = ("sglang:", "sglang_")
_ALL = tuple(p + n for p in PREFIXES for n in _NAMES)


class SglangAdapter(ModelLabelledAdapter):
    """Reads SGLang's scheduler gauges, selected by ``model_name`` and ``labels``."""

    kind = EngineKind.SGLANG
    support = SupportLevel.SUPPORTED

    async def discover(self, fetch: Fetcher, model_id: str) -> Discovery:
        resp = await self.get(fetch, self.url("/server_info"))
        if resp.status == 404:  # before 0.5.6 only the older route exists
            resp = await self.get(fetch, self.url("/get_server_info"))
        expect_status(resp, 200, what="server_info")
        return parse_server_info(resp)

    def parse_metrics(self, text: str, model_id: str, *, url: str | None = None) -> Poll:
        samples = parse_samples(text, _ALL, url=url)
        selector = {"model_name": model_id, **self.labels}
        prefix = _prefix(samples, selector)

        def one(name: str) -> Sample:
            return _select_total(samples, prefix + name, selector)

        queried, hits = _prefix_counts(samples, prefix, selector)
        return Poll(
            EngineMetrics(
                running_requests=int(finite(one(RUNNING))),
                waiting_requests=int(finite(one(WAITING))),
                kv_cache_usage_ratio=finite(one(TOKEN_USAGE), high=1.0),
                prefix_cache_queried_tokens_total=queried,
                prefix_cache_hit_tokens_total=hits,
            )
        )


def _prefix_counts(
    samples: Mapping[str, list[Sample]], prefix: str, selector: Mapping[str, str]
) -> tuple[float | None, float | None]:
    """Prompt tokens (cached ones included) and cached prompt tokens, each the sum of its
    series for the selected model, one per ``is_streaming`` or ``cache_source`` value.

    The cached counter has no series until a request finds a cached token: till then both stay
    None (a zero nobody published is not shown). Two series for one split value (two engines
    behind one exposition) cannot be told apart: both stay None then too."""
    queried = _split_sum(samples[prefix + PROMPT], selector, "is_streaming")
    hits = _split_sum(samples[prefix + CACHED], selector, "cache_source")
    if queried is None or hits is None:
        return None, None
    return queried, hits


def _split_sum(series: list[Sample], selector: Mapping[str, str], split: str) -> float | None:
    seen: dict[str, float] = {}
    for s in series:
        if any(s.labels.get(k) != v for k, v in selector.items()):
            continue
        if set(s.labels) - set(selector) - {split}:  # another label: not one engine's series
            return None
        value = s.labels.get(split, "")
        if value in seen:
            return None
        seen[value] = finite(s)
    return sum(seen.values()) if seen else None


def _prefix(samples: Mapping[str, list[Sample]], selector: Mapping[str, str]) -> str:
    found = [
        p
        for p in PREFIXES
        if any(all(s.labels.get(k) == v for k, v in selector.items()) for s in samples[p + RUNNING])
    ]
    if len(found) > 1:
        raise SnapshotValidationError(
            f"the exposition carries both sglang: and sglang_ metrics for {dict(selector)}; "
            "scrape one engine's own /metrics",
            metric="sglang:" + RUNNING,
        )
    if not found:
        seen = [s.labels for p in PREFIXES for s in samples[p + RUNNING]]
        raise MissingMetricError("sglang:" + RUNNING, selector=selector, seen=seen)
    return found[0]


def _select_total(
    samples: Mapping[str, list[Sample]], name: str, selector: Mapping[str, str]
) -> Sample:
    """With priority scheduling, SGLang publishes the total as ``priority=""`` beside one series
    per priority. Summing them would double-count; the total series is the one to read."""
    if "priority" not in selector:
        candidates = [
            s for s in samples[name] if all(s.labels.get(k) == v for k, v in selector.items())
        ]
        if len(candidates) > 1 and all("priority" in s.labels for s in candidates):
            return select_one(samples, name, {**selector, "priority": ""})
    return select_one(samples, name, selector)


def parse_server_info(resp: RawResponse) -> Discovery:
    """Capacity and version from ``/server_info``; unknown figures stay None."""
    info = json_object(resp, what="server_info")
    states = info.get("internal_states")
    per_dp = (
        [
            int_or_none(s.get("effective_max_running_requests_per_dp"))
            for s in states
            if isinstance(s, dict)
        ]
        if isinstance(states, list)
        else []
    )
    notes: list[str] = []
    if per_dp and all(v is not None for v in per_dp):
        max_running: int | None = sum(v for v in per_dp if v is not None)
    else:
        max_running = int_or_none(info.get("max_running_requests"))
        if max_running is None:
            notes.append("server_info publishes no max_running_requests (configured as null)")
    kv = int_or_none(info.get("max_total_num_tokens"))
    if kv is None and isinstance(states, list) and states and isinstance(states[0], dict):
        usage = states[0].get("memory_usage")
        kv = int_or_none(usage.get("token_capacity")) if isinstance(usage, dict) else None
    if kv is None:
        notes.append("server_info publishes no KV token pool size")
    version = info.get("version")
    if version is not None and not isinstance(version, str):
        raise InfoParseError(f"server_info: version is not a string: {version!r}", url=resp.url)
    start = info.get("startup_time")
    return Discovery(
        capacity=Capacity(kv_cache_tokens=kv, max_running_requests=max_running, notes=tuple(notes)),
        engine_version=version,
        process_start=float(start) if isinstance(start, (int, float)) else None,
    )
