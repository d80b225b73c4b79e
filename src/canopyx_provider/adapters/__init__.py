"""Engine adapters and their factories."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from .._errors import ConfigError
from .._snapshot import EngineKind
from ._base import Discovery as Discovery
from ._base import EngineAdapter as EngineAdapter
from ._base import Poll as Poll
from ._base import origin as origin
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
    "adapter_for",
    "llama_cpp",
    "mlx",
    "ollama",
    "origin",
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


_FACTORIES: Mapping[EngineKind, Callable[..., EngineAdapter]] = MappingProxyType(
    {
        EngineKind.VLLM: vllm,
        EngineKind.SGLANG: sglang,
        EngineKind.LLAMACPP: llama_cpp,
        EngineKind.OLLAMA: ollama,
        EngineKind.MLX: mlx,
        EngineKind.TABBYAPI: tabby_api,
        EngineKind.TENSORFOLD: tensorfold,
    }
)
"""The factory of each engine kind: the one place a kind's name meets its adapter."""

_LABELLED = frozenset({EngineKind.VLLM, EngineKind.SGLANG, EngineKind.LLAMACPP})
"""Kinds whose metric samples carry labels that can select one engine."""


def adapter_for(
    kind: EngineKind | str,
    base_url: str,
    *,
    api_key: str | None = None,
    labels: Mapping[str, str] | None = None,
    metrics_url: str | None = None,
    router: bool = False,
    slots: int | None = None,
) -> EngineAdapter:
    """The adapter for an engine named by its kind, e.g. from a configuration file.

    Args:
        kind: an `EngineKind` or its value (``"vllm"``, ``"llamacpp"``, ``"tabbyapi"``...).
        base_url, api_key, metrics_url: as for every factory (see `vllm`).
        labels: vLLM, SGLang and llama.cpp only.
        router, slots: llama.cpp only (see `llama_cpp`).

    Raises:
        ConfigError: an unknown kind, or an option the kind does not take; ``option`` names it
            (``kind``, ``labels``, ``router`` or ``slots``).
    """
    try:
        kind = EngineKind(kind)
    except ValueError:
        known = ", ".join(k.value for k in EngineKind)
        raise ConfigError(
            f"unknown engine kind {kind!r}; the known kinds are {known}", option="kind"
        ) from None
    options: dict[str, object] = {"api_key": api_key, "metrics_url": metrics_url}
    if kind is EngineKind.LLAMACPP:
        options.update(router=router, slots=slots)
    elif router or slots is not None:
        raise ConfigError(
            f"router and slots apply to llamacpp only, not {kind.value}",
            option="router" if router else "slots",
        )
    if kind in _LABELLED:
        options["labels"] = labels
    elif labels:
        raise ConfigError(
            f"labels do not apply to {kind.value}: it publishes no labelled metrics",
            option="labels",
        )
    return _FACTORIES[kind](base_url, **options)
