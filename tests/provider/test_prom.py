from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from canopyx_provider import AmbiguousMetricError, MetricsParseError, MissingMetricError
from canopyx_provider._prom import parse_samples, select_one

PAGE = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 2.0
vllm:num_requests_running{model_name="tiny",engine="0"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
this line { is not prometheus at all
"""


def test_only_exact_names_are_read_and_junk_elsewhere_is_ignored() -> None:
    found = parse_samples(PAGE, ["vllm:num_requests_waiting", "vllm:absent"])
    assert [s.value for s in found["vllm:num_requests_waiting"]] == [2.0]
    assert found["vllm:absent"] == []


def test_labels_are_matched_by_name_not_position() -> None:
    found = parse_samples(PAGE, ["vllm:num_requests_running"])
    one = select_one(found, "vllm:num_requests_running", {"model_name": "tiny", "engine": "0"})
    assert one.value == 3.0


def test_ambiguous_selection_names_every_label_set() -> None:
    found = parse_samples(PAGE, ["vllm:num_requests_running"])
    with pytest.raises(AmbiguousMetricError) as info:
        select_one(found, "vllm:num_requests_running", {"model_name": "tiny"})
    assert 'engine="0"' in str(info.value) and 'engine="1"' in str(info.value)
    assert info.value.metric == "vllm:num_requests_running"


def test_missing_selection_names_the_metric_and_what_was_seen() -> None:
    found = parse_samples(PAGE, ["vllm:num_requests_running", "vllm:kv_cache_usage_perc"])
    with pytest.raises(MissingMetricError) as info:
        select_one(found, "vllm:num_requests_running", {"model_name": "other"})
    assert "vllm:num_requests_running" in str(info.value)
    assert 'model_name="tiny"' in str(info.value)
    with pytest.raises(MissingMetricError, match="does not publish it"):
        select_one(found, "vllm:kv_cache_usage_perc", {})


def test_a_malformed_wanted_line_is_a_parse_error() -> None:
    with pytest.raises(MetricsParseError):
        parse_samples(
            'vllm:num_requests_running{model_name="tiny" 1.0\n', ["vllm:num_requests_running"]
        )


def test_scientific_notation_counters_parse_as_floats() -> None:
    found = parse_samples(
        "llamacpp:prompt_tokens_total 1.23457e+06\n", ["llamacpp:prompt_tokens_total"]
    )
    assert found["llamacpp:prompt_tokens_total"][0].value == 1234570.0


@given(st.text())
def test_arbitrary_text_never_raises_anything_but_a_parse_error(text: str) -> None:
    names = ["vllm:num_requests_running", "llamacpp:requests_processing"]
    try:
        found = parse_samples(text, names)
    except MetricsParseError:
        return
    assert set(found) == set(names)


@given(st.lists(st.tuples(st.sampled_from(["0", "1", "2"]), st.floats(0, 1e9)), max_size=5))
def test_generated_expositions_round_trip(series: list[tuple[str, float]]) -> None:
    text = "".join(
        f'vllm:num_requests_running{{engine="{e}",model_name="m"}} {v!r}\n' for e, v in series
    )
    found = parse_samples(text, ["vllm:num_requests_running"])
    assert [(s.labels["engine"], s.value) for s in found["vllm:num_requests_running"]] == series
