"""`adapter_for`: one table from an engine kind to its adapter, and the options each kind takes."""

from __future__ import annotations

import pytest

from canopyx_provider import ConfigError, EngineAdapter, EngineKind, adapter_for
from canopyx_provider.adapters import (
    LlamaCppAdapter,
    MlxAdapter,
    OllamaAdapter,
    SglangAdapter,
    TabbyApiAdapter,
    TensorFoldAdapter,
    VllmAdapter,
)

BASE = "http://127.0.0.1:8000"
CLASSES: dict[EngineKind, type[EngineAdapter]] = {
    EngineKind.VLLM: VllmAdapter,
    EngineKind.SGLANG: SglangAdapter,
    EngineKind.LLAMACPP: LlamaCppAdapter,
    EngineKind.OLLAMA: OllamaAdapter,
    EngineKind.MLX: MlxAdapter,
    EngineKind.TABBYAPI: TabbyApiAdapter,
    EngineKind.TENSORFOLD: TensorFoldAdapter,
}
HEALTH_ONLY = [EngineKind.OLLAMA, EngineKind.MLX, EngineKind.TABBYAPI, EngineKind.TENSORFOLD]


def test_every_kind_is_covered() -> None:
    assert set(CLASSES) == set(EngineKind)


@pytest.mark.parametrize(("kind", "cls"), CLASSES.items())
def test_each_kind_gets_its_adapter_by_enum_and_by_name(
    kind: EngineKind, cls: type[EngineAdapter]
) -> None:
    for given in (kind, kind.value):
        adapter = adapter_for(given, BASE + "/v1", api_key="k", metrics_url=BASE + "/m")
        assert type(adapter) is cls
        assert adapter.kind is kind
        assert adapter.base_url == BASE
        assert adapter.metrics_url == BASE + "/m"
        assert adapter.headers == {"Authorization": "Bearer k"}


def test_llamacpp_options_reach_the_adapter() -> None:
    adapter = adapter_for("llamacpp", BASE, labels={"a": "b"}, router=True, slots=4)
    assert isinstance(adapter, LlamaCppAdapter)
    assert (adapter.labels, adapter.router, adapter.slots) == ({"a": "b"}, True, 4)


@pytest.mark.parametrize("kind", [EngineKind.VLLM, EngineKind.SGLANG])
def test_labels_reach_labelled_engines(kind: EngineKind) -> None:
    assert adapter_for(kind, BASE, labels={"engine": "0"}).labels == {"engine": "0"}


@pytest.mark.parametrize("name", ["nope", "llama_cpp", "VLLM", ""])
def test_an_unknown_kind_is_refused_naming_the_known_ones(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        adapter_for(name, BASE)
    assert isinstance(info.value, ValueError)
    assert info.value.option == "kind"
    assert str(info.value) == (
        f"unknown engine kind {name!r}; the known kinds are "
        "vllm, sglang, llamacpp, ollama, mlx, tabbyapi, tensorfold"
    )


@pytest.mark.parametrize("kind", [k for k in EngineKind if k is not EngineKind.LLAMACPP])
@pytest.mark.parametrize(
    ("options", "option"), [({"router": True}, "router"), ({"slots": 2}, "slots")]
)
def test_router_and_slots_are_llamacpp_only(
    kind: EngineKind, options: dict[str, bool | int], option: str
) -> None:
    with pytest.raises(ConfigError, match=f"llamacpp only, not {kind.value}$") as info:
        adapter_for(kind, BASE, **options)  # type: ignore[arg-type]
    assert info.value.option == option


@pytest.mark.parametrize("kind", HEALTH_ONLY)
def test_labels_are_refused_where_no_metric_carries_them(kind: EngineKind) -> None:
    with pytest.raises(ConfigError, match=f"^labels do not apply to {kind.value}:") as info:
        adapter_for(kind, BASE, labels={"engine": "0"})
    assert info.value.option == "labels"
    assert adapter_for(kind, BASE, labels={}).labels == {}  # no labels is not a label


def test_a_bad_base_url_is_refused_by_the_adapter() -> None:
    with pytest.raises(ConfigError, match="base_url must be an http") as info:
        adapter_for("vllm", "127.0.0.1:8000")
    assert info.value.option == "base_url"
