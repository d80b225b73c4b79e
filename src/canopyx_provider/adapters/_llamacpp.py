"""llama.cpp ``llama-server`` started with ``--metrics``; contract target b10795, verified
live on build 10798. Router mode (``--models-dir``) is read per model with ``?model=`` and
``autoload=false``, so that collecting never makes the router load a model."""

from __future__ import annotations

from urllib.parse import urlencode

from .._errors import ConfigError, InfoParseError, ScrapeError, SnapshotValidationError
from .._prom import finite, parse_samples, select_one
from .._scrape import Fetcher, RawResponse
from .._snapshot import Capacity, EngineKind, EngineMetrics, SupportLevel
from ._base import Discovery, EngineAdapter, Poll, expect_status, int_or_none, json_object

__all__ = ["LlamaCppAdapter"]

PROCESSING = "llamacpp:requests_processing"
DEFERRED = "llamacpp:requests_deferred"
PROMPT_TOKENS = "llamacpp:prompt_tokens_total"
PREDICTED_TOKENS = "llamacpp:tokens_predicted_total"
CACHED_TOKENS = "llamacpp:prompt_tokens_cached_total"
"""Prompt tokens reused from the cache; ``prompt_tokens_total`` counts the others (b10795 on)."""
_POLLED = (PROCESSING, DEFERRED, PROMPT_TOKENS, PREDICTED_TOKENS, CACHED_TOKENS)
START_HEADER = "process-start-time-unix"


class LlamaCppAdapter(EngineAdapter):
    """Reads llama-server's processing/deferred gauges and ``/props`` slots and build."""

    kind = EngineKind.LLAMACPP
    support = SupportLevel.SUPPORTED

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        labels: dict[str, str] | None = None,
        metrics_url: str | None = None,
        router: bool = False,
        slots: int | None = None,
    ) -> None:
        super().__init__(base_url, api_key=api_key, labels=labels, metrics_url=metrics_url)
        if slots is not None and slots < 1:
            raise ConfigError(f"slots must be a positive number of slots, got {slots}")
        self.router = router
        self.slots = slots

    def _model_query(self, url: str, model_id: str) -> str:
        if not self.router:
            return url
        sep = "&" if "?" in url else "?"
        return url + sep + urlencode({"model": model_id, "autoload": "false"})

    async def discover(self, fetch: Fetcher, model_id: str) -> Discovery:
        url = self._model_query(self.url("/props"), model_id)
        try:
            resp: RawResponse | None = await self.get(fetch, url)
        except ScrapeError:
            if self.slots is None:
                raise
            resp = None
        if resp is not None and resp.status == 200:
            return self.parse_props(resp)
        if self.slots is None and resp is not None:
            expect_status(resp, 200, what="props (pass slots= when /props is unavailable)")
        problem = "no answer" if resp is None else f"it answered {resp.status}"
        return Discovery(
            capacity=Capacity(
                total_slots=self.slots,
                max_running_requests=self.slots,
                notes=(f"total_slots from the slots option: /props was unavailable ({problem})",),
            )
        )

    def parse_props(self, resp: RawResponse) -> Discovery:
        props = json_object(resp, what="props")
        total = int_or_none(props.get("total_slots"))
        if total is None or total < 1:
            if props.get("role") == "router":
                raise InfoParseError(
                    "props: this is a router-mode server; pass router=True", url=resp.url
                )
            if self.slots is None:
                raise InfoParseError(
                    f"props: {resp.url} has no total_slots; pass slots=", url=resp.url
                )
            total = self.slots
        settings = props.get("default_generation_settings")
        n_ctx = int_or_none(settings.get("n_ctx")) if isinstance(settings, dict) else None
        notes = ("kv_cache_tokens is n_ctx per slot x total_slots",) if n_ctx else ()
        build = props.get("build_info")
        return Discovery(
            capacity=Capacity(
                total_slots=total,
                kv_cache_tokens=n_ctx * total if n_ctx else None,
                max_running_requests=total,
                notes=notes,
            ),
            engine_version=_build(build) if isinstance(build, str) else None,
        )

    async def collect(
        self, fetch: Fetcher, model_id: str, discovery: Discovery, health: RawResponse
    ) -> Poll:
        resp = await self.get(fetch, self._model_query(self.metrics_url, model_id))
        expect_status(resp, 200, what="metrics")
        total = discovery.capacity.total_slots if discovery.capacity else self.slots
        poll = self.parse_metrics(resp.text(), total_slots=total, url=resp.url)
        start = resp.headers.get(START_HEADER)
        if start is not None:
            try:
                return Poll(poll.metrics, process_start=float(start))
            except ValueError:
                pass
        return poll

    def parse_metrics(self, text: str, *, total_slots: int | None, url: str | None = None) -> Poll:
        samples = parse_samples(text, _POLLED, url=url)
        processing = int(finite(select_one(samples, PROCESSING, self.labels)))
        ratio = None
        if total_slots is not None:
            if processing > total_slots:
                raise SnapshotValidationError(
                    f"{PROCESSING} is {processing} but the engine has {total_slots} slots",
                    metric=PROCESSING,
                )
            ratio = processing / total_slots
        prompt = finite(select_one(samples, PROMPT_TOKENS, self.labels))
        cached = (
            finite(select_one(samples, CACHED_TOKENS, self.labels))
            if samples.get(CACHED_TOKENS)
            else None
        )
        return Poll(
            EngineMetrics(
                running_requests=processing,
                waiting_requests=int(finite(select_one(samples, DEFERRED, self.labels))),
                slot_usage_ratio=ratio,
                prompt_tokens_total=prompt,
                generated_tokens_total=finite(select_one(samples, PREDICTED_TOKENS, self.labels)),
                prefix_cache_queried_tokens_total=None if cached is None else prompt + cached,
                prefix_cache_hit_tokens_total=cached,
            )
        )


def _build(build_info: str) -> str:
    """``b10798-unknown`` -> ``b10798``: the build number is what identifies a release."""
    return build_info.split("-", 1)[0]
