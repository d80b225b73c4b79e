"""vLLM (V1 engine), contract target 0.17.1; verified live on the CPU build 0.31.0."""

from __future__ import annotations

from .._errors import InfoParseError, SnapshotValidationError
from .._prom import Sample, finite, parse_samples, select_one
from .._scrape import Fetcher, RawResponse
from .._snapshot import Capacity, EngineKind, EngineMetrics, SupportLevel
from ._base import Discovery, ModelLabelledAdapter, Poll, expect_status, int_or_none, json_object

__all__ = ["VllmAdapter"]

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATED_TOKENS = "vllm:generation_tokens_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
CACHE_CONFIG = "vllm:cache_config_info"
PROCESS_START = "process_start_time_seconds"

NO_SEQUENCE_LIMIT = (
    "vLLM does not publish its limit on concurrent sequences (max_num_seqs): "
    "max_running_requests is unknown"
)

_POLLED = (
    RUNNING,
    WAITING,
    KV_USAGE,
    PROMPT_TOKENS,
    GENERATED_TOKENS,
    PREFIX_QUERIES,
    PREFIX_HITS,
    PROCESS_START,
)


class VllmAdapter(ModelLabelledAdapter):
    """Reads a single vLLM engine's gauges, selected by ``model_name`` and ``labels``."""

    kind = EngineKind.VLLM
    support = SupportLevel.SUPPORTED

    async def discover(self, fetch: Fetcher, model_id: str) -> Discovery:
        version = parse_version(await self.get(fetch, self.url("/version")))
        resp = await self.get(fetch, self.metrics_url)
        expect_status(resp, 200, what="metrics")
        return Discovery(
            capacity=self.parse_capacity(resp.text(), url=resp.url), engine_version=version
        )

    def parse_metrics(self, text: str, model_id: str, *, url: str | None = None) -> Poll:
        samples = parse_samples(text, _POLLED, url=url)
        selector = {"model_name": model_id, **self.labels}

        def one(name: str) -> Sample:
            return select_one(samples, name, selector)

        metrics = EngineMetrics(
            running_requests=int(finite(one(RUNNING))),
            waiting_requests=int(finite(one(WAITING))),
            kv_cache_usage_ratio=finite(one(KV_USAGE), high=1.0),
            prompt_tokens_total=_optional(samples, PROMPT_TOKENS, selector),
            generated_tokens_total=_optional(samples, GENERATED_TOKENS, selector),
            prefix_cache_queried_tokens_total=_optional(samples, PREFIX_QUERIES, selector),
            prefix_cache_hit_tokens_total=_optional(samples, PREFIX_HITS, selector),
        )
        starts = samples[PROCESS_START]
        return Poll(metrics, process_start=starts[0].value if len(starts) == 1 else None)

    def parse_capacity(self, text: str, *, url: str | None = None) -> Capacity:
        """KV cache size = num_gpu_blocks x block_size from ``vllm:cache_config_info``.

        The metric is a label dictionary whose keys change between versions, and it has no
        ``model_name`` label: only the user's other labels (``engine``) narrow it.
        """
        samples = parse_samples(text, (CACHE_CONFIG,), url=url)
        selector = {k: v for k, v in self.labels.items() if k != "model_name"}
        info = select_one(samples, CACHE_CONFIG, selector).labels
        blocks, block_size = (
            int_or_none(info.get("num_gpu_blocks")),
            int_or_none(info.get("block_size")),
        )
        notes = [NO_SEQUENCE_LIMIT]
        kv_tokens = None
        if blocks is None or block_size is None:
            notes.append(
                "vllm:cache_config_info has no num_gpu_blocks/block_size yet "
                f"(num_gpu_blocks={info.get('num_gpu_blocks')!r}): KV cache size unknown"
            )
        elif blocks < 0 or block_size <= 0:
            raise SnapshotValidationError(
                f"vllm:cache_config_info has num_gpu_blocks={blocks}, block_size={block_size}",
                metric=CACHE_CONFIG,
            )
        else:
            kv_tokens = blocks * block_size
        return Capacity(kv_cache_tokens=kv_tokens, notes=tuple(notes))


def parse_version(resp: RawResponse) -> str | None:
    """``{"version": "0.17.1"}`` from ``/version``; None where the route is not exposed."""
    if resp.status == 404:
        return None
    expect_status(resp, 200, what="version")
    version = json_object(resp, what="version").get("version")
    if not isinstance(version, str):
        raise InfoParseError(f"version: {resp.url} has no string version", url=resp.url)
    return version


def _optional(
    samples: dict[str, list[Sample]], name: str, selector: dict[str, str]
) -> float | None:
    """A counter the adapter reports when present; absent is None, never 0."""
    if not samples.get(name):
        return None
    return finite(select_one(samples, name, selector))
