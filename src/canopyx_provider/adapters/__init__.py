"""Engine adapters and their factories."""

from __future__ import annotations

from collections.abc import Mapping

from ._base import Discovery as Discovery
from ._base import EngineAdapter as EngineAdapter
from ._base import Poll as Poll
from ._limited import MlxAdapter as MlxAdapter
from ._limited import OllamaAdapter as OllamaAdapter
from ._limited import TabbyApiAdapter as TabbyApiAdapter
from ._llamacpp import LlamaCppAdapter as LlamaCppAdapter
from ._sglang import SglangAdapter as SglangAdapter
from ._tensorfold import TensorFoldAdapter as TensorFoldAdapter
from ._vllm import VllmAdapter as VllmAdapter

__all__ = (
    "Discovery",
    "EngineAdapter",
    "LlamaCppAdapter",
    "MlxAdapter",
    "OllamaAdapter",
    "Poll",
    "SglangAdapter",
    "TabbyApiAdapter",
    "TensorFoldAdapter",
    "VllmAdapter",
    "llama_cpp",
    "mlx",
    "ollama",
    "sglang",
    "tabby_api",
    "tensorfold",
    "vllm",
)


def vllm(
    base_url: str,
    *,
    api_key: str | None = None,
    labels: Mapping[str, str] | None = None,
    metrics_url: str | None = None,
) -> VllmAdapter:
    """An adapter for one vLLM engine.

    Args:
        base_url: the engine's origin (``http://127.0.0.1:8000``); any path is ignored.
        api_key: bearer credential sent on every collection request (see `engine_api_key`).
        labels: extra labels that select exactly one engine, e.g. ``{"engine": "0"}``.
        metrics_url: scrape this URL instead of ``<base_url>/metrics``.
    """
    return VllmAdapter(base_url, api_key=api_key, labels=labels, metrics_url=metrics_url)


def sglang(
    base_url: str,
    *,
    api_key: str | None = None,
    labels: Mapping[str, str] | None = None,
    metrics_url: str | None = None,
) -> SglangAdapter:
    """An adapter for one SGLang engine started with ``--enable-metrics``."""
    return SglangAdapter(base_url, api_key=api_key, labels=labels, metrics_url=metrics_url)


def llama_cpp(
    base_url: str,
    *,
    api_key: str | None = None,
    labels: Mapping[str, str] | None = None,
    metrics_url: str | None = None,
    router: bool = False,
    slots: int | None = None,
) -> LlamaCppAdapter:
    """An adapter for one ``llama-server`` started with ``--metrics``.

    Args:
        router: the server runs in router mode (``--models-dir``): select the model with
            ``?model=`` and never make it load one.
        slots: the number of slots, used when ``/props`` is unavailable.
    """
    return LlamaCppAdapter(
        base_url,
        api_key=api_key,
        labels=dict(labels or {}),
        metrics_url=metrics_url,
        router=router,
        slots=slots,
    )


def ollama(
    base_url: str, *, api_key: str | None = None, metrics_url: str | None = None
) -> OllamaAdapter:
    """A health-only adapter for Ollama."""
    return OllamaAdapter(base_url, api_key=api_key, metrics_url=metrics_url)


def mlx(base_url: str, *, api_key: str | None = None, metrics_url: str | None = None) -> MlxAdapter:
    """A health-only adapter for ``mlx_lm.server``."""
    return MlxAdapter(base_url, api_key=api_key, metrics_url=metrics_url)


def tabby_api(
    base_url: str, *, api_key: str | None = None, metrics_url: str | None = None
) -> TabbyApiAdapter:
    """A health-only adapter for TabbyAPI."""
    return TabbyApiAdapter(base_url, api_key=api_key, metrics_url=metrics_url)


def tensorfold(
    base_url: str, *, api_key: str | None = None, metrics_url: str | None = None
) -> TensorFoldAdapter:
    """An adapter for TensorFold, whose ``/health`` carries its load (for the gateway)."""
    return TensorFoldAdapter(base_url, api_key=api_key, metrics_url=metrics_url)
