"""The adapters' pure readers on recorded engine answers (see contract/recorded/)."""

from __future__ import annotations

import pytest

from canopyx_provider import (
    AmbiguousMetricError,
    ConfigError,
    MissingMetricError,
    SnapshotValidationError,
    llama_cpp,
    sglang,
    tensorfold,
    vllm,
)
from canopyx_provider._scrape import RawResponse
from canopyx_provider.adapters._base import parse_model_ids
from canopyx_provider.adapters._sglang import parse_server_info
from tests.conftest import recorded

BASE = "http://127.0.0.1:9"


def raw(rel: str) -> RawResponse:
    r = recorded(rel)
    return RawResponse(url="http://engine/" + rel, status=r.status, body=r.body, headers=r.headers)


# -- vLLM ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("rel", "model", "running", "waiting"),
    [
        ("vllm/0.31.0/GET_metrics_idle.http", "tiny", 0, 0),
        ("vllm/0.32.0/GET_metrics_busy_2_running.http", "tiny", 2, 0),
        ("vllm/0.17.1/GET_metrics.http", "Qwen/Qwen3-8B", 3, 1),
    ],
)
def test_vllm_reads_the_model_gauges(rel: str, model: str, running: int, waiting: int) -> None:
    poll = vllm(BASE).parse_metrics(recorded(rel).text, model)
    assert poll.metrics.running_requests == running
    assert poll.metrics.waiting_requests == waiting
    assert poll.metrics.kv_cache_usage_ratio is not None
    assert 0.0 <= poll.metrics.kv_cache_usage_ratio <= 1.0
    assert poll.metrics.slot_usage_ratio is None  # vLLM has no slots: absent, not 0


def test_vllm_prefix_cache_counters_are_read_and_absent_ones_stay_none() -> None:
    text = recorded("vllm/0.32.0/GET_metrics_busy_2_running.http").text
    m = vllm(BASE).parse_metrics(text, "tiny").metrics
    assert m.prefix_cache_queried_tokens_total == 65.0
    assert m.prefix_cache_hit_tokens_total is not None
    stripped = "\n".join(line for line in text.splitlines() if "prefix_cache_" not in line)
    m = vllm(BASE).parse_metrics(stripped, "tiny").metrics
    assert m.prefix_cache_queried_tokens_total is None and m.prefix_cache_hit_tokens_total is None


def test_vllm_kv_cache_size_comes_from_cache_config_info_labels() -> None:
    cap = vllm(BASE).parse_capacity(recorded("vllm/0.31.0/GET_metrics_idle.http").text)
    assert cap.kv_cache_tokens == 8192 * 128
    assert cap.max_running_requests is None
    assert any("does not publish" in n for n in cap.notes)


def test_vllm_process_start_is_read_when_published() -> None:
    poll = vllm(BASE).parse_metrics(recorded("vllm/0.32.0/GET_metrics_idle.http").text, "tiny")
    assert poll.process_start == pytest.approx(1.79604298065e9)
    # Under --api-server-count>1 there are no process_* series: no marker, and no failure.
    text = recorded("vllm/0.17.1/GET_metrics.http").text
    assert "process_start_time_seconds" not in text
    assert vllm(BASE).parse_metrics(text, "Qwen/Qwen3-8B").process_start is None


def test_vllm_data_parallel_engines_are_ambiguous_until_labels_select_one() -> None:
    text = recorded("vllm/0.17.1/GET_metrics_two_engines.http").text
    with pytest.raises(AmbiguousMetricError) as info:
        vllm(BASE).parse_metrics(text, "Qwen/Qwen3-8B")
    assert 'engine="0"' in str(info.value) and 'engine="1"' in str(info.value)
    poll = vllm(BASE, labels={"engine": "1"}).parse_metrics(text, "Qwen/Qwen3-8B")
    assert (poll.metrics.running_requests, poll.metrics.waiting_requests) == (5, 0)  # never 3+5
    assert vllm(BASE, labels={"engine": "1"}).parse_capacity(text).kv_cache_tokens is not None


def test_vllm_other_model_is_missing_and_names_what_was_seen() -> None:
    text = recorded("vllm/0.31.0/GET_metrics_idle.http").text
    with pytest.raises(MissingMetricError) as info:
        vllm(BASE).parse_metrics(text, "not-served")
    assert info.value.metric == "vllm:num_requests_running"
    assert 'model_name="tiny"' in str(info.value)


def test_vllm_unprofiled_cache_config_leaves_kv_size_unknown() -> None:
    text = 'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="None"} 1.0\n'
    cap = vllm(BASE).parse_capacity(text)
    assert cap.kv_cache_tokens is None
    assert any("num_gpu_blocks" in n for n in cap.notes)


def test_vllm_kv_usage_above_one_is_refused() -> None:
    text = (
        'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 37.5\n'
    )
    with pytest.raises(SnapshotValidationError, match="kv_cache_usage_perc"):
        vllm(BASE).parse_metrics(text, "m")


# -- SGLang -------------------------------------------------------------------------------
def test_sglang_reads_gauges_and_counters() -> None:
    poll = sglang(BASE).parse_metrics(
        recorded("sglang/0.5.21/GET_metrics.http").text, "Qwen/Qwen3-8B"
    )
    m = poll.metrics
    assert m.running_requests is not None and m.waiting_requests is not None
    assert m.kv_cache_usage_ratio is not None and 0 <= m.kv_cache_usage_ratio <= 1
    # Its token counters are split by is_streaming and lack the engine labels: left out, not summed.
    assert m.prompt_tokens_total is None and m.generated_tokens_total is None


def test_sglang_prefix_cache_counts_sum_their_splits_and_stay_none_before_a_hit() -> None:
    """Prompt tokens summed over is_streaming, cached tokens over cache_source; the cached
    counter has no series before the first hit, and then neither figure is claimed."""
    text = recorded("sglang/0.5.21/GET_metrics.http").text
    m = sglang(BASE).parse_metrics(text, "Qwen/Qwen3-8B").metrics
    assert m.prefix_cache_queried_tokens_total is None and m.prefix_cache_hit_tokens_total is None
    cached = (
        "# TYPE sglang:cached_tokens_total counter\n"
        'sglang:cached_tokens_total{cache_source="device",model_name="Qwen/Qwen3-8B"} 900.0\n'
        'sglang:cached_tokens_total{cache_source="host",model_name="Qwen/Qwen3-8B"} 100.0\n'
        'sglang:prompt_tokens_total{is_streaming="false",model_name="Qwen/Qwen3-8B"} 767.0\n'
    )
    m = sglang(BASE).parse_metrics(text + cached, "Qwen/Qwen3-8B").metrics
    assert (m.prefix_cache_queried_tokens_total, m.prefix_cache_hit_tokens_total) == (
        183000.0,
        1000.0,
    )
    # A second engine's series for the same split value: not one engine's count.
    twice = cached + cached.replace("900.0", "5.0").replace("# TYPE", "# X")
    m = sglang(BASE).parse_metrics(text + twice, "Qwen/Qwen3-8B").metrics
    assert m.prefix_cache_queried_tokens_total is None and m.prefix_cache_hit_tokens_total is None


def test_sglang_priority_total_is_the_empty_priority_series_not_a_sum() -> None:
    text = recorded("sglang/0.5.21/GET_metrics_priority.http").text
    m = sglang(BASE).parse_metrics(text, "Qwen/Qwen3-8B").metrics
    assert m.running_requests == 4  # not 4 + 3 + 1
    assert m.waiting_requests == 2


def test_sglang_dp_ranks_need_a_label() -> None:
    text = recorded("sglang/0.5.21/GET_metrics_two_dp_ranks.http").text
    with pytest.raises(AmbiguousMetricError, match="dp_rank"):
        sglang(BASE).parse_metrics(text, "Qwen/Qwen3-8B")
    one = sglang(BASE, labels={"dp_rank": "1"}).parse_metrics(text, "Qwen/Qwen3-8B")
    assert one.metrics.running_requests is not None


def test_sglang_underscore_prefix_is_accepted_but_never_mixed() -> None:
    text = recorded("sglang/0.5.21/GET_metrics.http").text
    underscored = text.replace("sglang:", "sglang_")
    plain = sglang(BASE).parse_metrics(text, "Qwen/Qwen3-8B").metrics
    assert sglang(BASE).parse_metrics(underscored, "Qwen/Qwen3-8B").metrics == plain
    with pytest.raises(SnapshotValidationError, match="both sglang: and sglang_"):
        sglang(BASE).parse_metrics(text + underscored, "Qwen/Qwen3-8B")


def test_sglang_server_info_gives_capacity_and_version() -> None:
    d = parse_server_info(raw("sglang/0.5.21/GET_server_info.http"))
    assert d.engine_version == "0.5.21"
    assert d.capacity is not None
    assert d.capacity.kv_cache_tokens == 442368
    assert d.capacity.max_running_requests == 4096  # effective, not the null configured value


# -- llama.cpp ----------------------------------------------------------------------------
def test_llamacpp_busy_slots_give_slot_usage() -> None:
    text = recorded("llamacpp/b10798/GET_metrics_busy_2_generating.http").text
    m = llama_cpp(BASE).parse_metrics(text, total_slots=2).metrics
    assert (m.running_requests, m.slot_usage_ratio) == (2, 1.0)
    assert m.kv_cache_usage_ratio is None
    assert m.prompt_tokens_total is not None and m.generated_tokens_total is not None


def test_llamacpp_prefix_cache_figures_count_cached_and_uncached_prompt_tokens() -> None:
    text = recorded("llamacpp/b10798/GET_metrics_after.http").text
    m = llama_cpp(BASE).parse_metrics(text, total_slots=2).metrics
    # prompt_tokens_total excludes cached tokens: what was looked up is both.
    assert (m.prefix_cache_queried_tokens_total, m.prefix_cache_hit_tokens_total) == (112.0, 23.0)
    older = recorded("llamacpp/b10795/router/GET_metrics_two_models.txt").text
    second = older.split("# --- body of", 2)[2]
    m = llama_cpp(BASE).parse_metrics(second, total_slots=None).metrics
    assert m.prefix_cache_queried_tokens_total is None and m.prefix_cache_hit_tokens_total is None


def test_llamacpp_without_slots_has_no_slot_usage() -> None:
    text = recorded("llamacpp/b10798/GET_metrics_idle.http").text
    m = llama_cpp(BASE).parse_metrics(text, total_slots=None).metrics
    assert m.running_requests == 0
    assert m.slot_usage_ratio is None


def test_llamacpp_more_processing_than_slots_is_refused() -> None:
    text = recorded("llamacpp/b10798/GET_metrics_busy_2_generating.http").text
    with pytest.raises(SnapshotValidationError, match="slots"):
        llama_cpp(BASE, slots=1).parse_metrics(text, total_slots=1)


def test_llamacpp_props_give_slots_and_build() -> None:
    d = llama_cpp(BASE).parse_props(raw("llamacpp/b10798/GET_props.http"))
    assert d.engine_version == "b10798"
    assert d.capacity is not None and d.capacity.total_slots == 2
    assert d.capacity.kv_cache_tokens == 4096 * 2


def test_llamacpp_router_props_without_a_model_are_refused() -> None:
    with pytest.raises(Exception, match="router"):
        llama_cpp(BASE).parse_props(raw("llamacpp/b10798/router/GET_props.http"))


def test_llamacpp_scientific_counter_from_the_router_sample() -> None:
    text = recorded("llamacpp/b10795/router/GET_metrics_two_models.txt").text
    second = text.split("# --- body of", 2)[2]
    m = llama_cpp(BASE).parse_metrics(second, total_slots=None).metrics
    assert m.prompt_tokens_total == 1234570.0


def test_llamacpp_slots_must_be_positive() -> None:
    with pytest.raises(ConfigError):
        llama_cpp(BASE, slots=0)


# -- TensorFold, model lists, origins -----------------------------------------------------
def test_tensorfold_health_carries_the_load() -> None:
    m = tensorfold(BASE).parse_health_load(raw("tensorfold/0.6.1/GET_health.http")).metrics
    assert (m.running_requests, m.busy, m.waiting_requests) == (2, True, None)
    idle = tensorfold(BASE).parse_health_load(raw("tensorfold/0.6.1/GET_health_idle.http")).metrics
    assert idle.idle is True


def test_tensorfold_with_keys_publishes_no_load_and_says_why() -> None:
    with pytest.raises(SnapshotValidationError, match="API keys"):
        tensorfold(BASE).parse_health_load(raw("tensorfold/0.6.1/GET_health_with_keys.http"))


@pytest.mark.parametrize(
    ("rel", "ids"),
    [
        ("vllm/0.31.0/GET_v1_models.http", ("tiny",)),
        ("llamacpp/b10798/GET_v1_models.http", ("tiny",)),
        ("sglang/0.5.21/GET_v1_models.http", ("Qwen/Qwen3-8B",)),
        ("mlx/0.32.2/GET_v1_models.http", ("mlx-community/Qwen3-4B-4bit", "/models/local-qwen")),
    ],
)
def test_model_lists(rel: str, ids: tuple[str, ...]) -> None:
    assert parse_model_ids(raw(rel))[: len(ids)] == ids


@pytest.mark.parametrize(
    ("given", "origin"),
    [
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
        ("https://gpu.example:443/api/?x=1#f", "https://gpu.example:443"),
        ("http://user:pw@127.0.0.1:8000/", "http://127.0.0.1:8000"),
        ("http://[::1]:8000/v1", "http://[::1]:8000"),
        (" HTTP://GPU-Box.lan:8000 ", "http://gpu-box.lan:8000"),
        ("http://engine_0:", "http://engine_0"),
    ],
)
def test_base_url_is_an_origin(given: str, origin: str) -> None:
    assert vllm(given).base_url == origin


@pytest.mark.parametrize(
    "bad",
    [
        "127.0.0.1:8000",
        "ftp://x",
        "http://",
        "http://user@:8000",
        "http://127.0.0.1:http",
        "http://127.0.0.1:0",
        "http://127.0.0.1:65536",
        "http://[::1",
        "http://[not-ipv6]:80",
        "http://gpu box:8000",
        "http://evil\\@127.0.0.1:8000",
        "http://%31%32%37.0.0.1:8000",
        "http://x;y:8000",
    ],
)
def test_bad_base_url_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="^base_url must be an http") as info:
        vllm(bad)
    assert info.value.option == "base_url"


def test_a_refused_url_keeps_its_credentials_out_of_the_message() -> None:
    with pytest.raises(ConfigError) as info:
        vllm("http://user:s3cret@127.0.0.1:http/")
    assert "s3cret" not in str(info.value)
    assert "//***@127.0.0.1:http/" in str(info.value)


@pytest.mark.parametrize("bad", ["/metrics", "ftp://x/metrics", "http:///metrics", "http://x:y/m"])
def test_bad_metrics_url_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="^metrics_url must be an http") as info:
        vllm(BASE, metrics_url=bad)
    assert info.value.option == "metrics_url"
