"""``canopyx-provider`` through typer's runner, against engines on real sockets."""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest
from pytest_httpserver import HTTPServer
from typer.testing import CliRunner

from canopyx_provider.cli import app
from tests.provider.fakes import llamacpp_10798, vllm_031

runner = CliRunner()


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = runner.invoke(app, list(args), env=env)
    return result.exit_code, result.output


def test_check_json_passes_against_a_vllm_engine(engine: HTTPServer) -> None:
    vllm_031(engine)
    code, out = invoke(
        "check", "--engine", "vllm", "--base-url", engine.url_for("/"), "--model", "tiny", "--json"
    )
    assert code == 0, out
    doc = json.loads(out)
    assert doc["checks"] == [
        {"name": n, "ok": True, "reason": None}
        for n in ("health", "models", "discovery", "metrics")
    ]
    assert doc["metrics"] == {
        "running_requests": 0,
        "waiting_requests": 0,
        "kv_cache_usage_ratio": 0.0,
        "prompt_tokens_total": 24.0,
        "generated_tokens_total": 16.0,
        "prefix_cache_queried_tokens_total": 24.0,
        "prefix_cache_hit_tokens_total": 0.0,
    }
    assert doc["engine_version"] == "0.31.0"
    assert doc["capacity"]["kv_cache_tokens"] == 1048576


def test_check_fails_with_exit_1_and_names_the_check(engine: HTTPServer) -> None:
    vllm_031(engine)
    code, out = invoke(
        "check", "--engine", "vllm", "--base-url", engine.url_for("/"), "--model", "nope", "--json"
    )
    assert code == 1
    doc = json.loads(out)
    assert doc["checks"][1] == {
        "name": "models",
        "ok": False,
        "reason": "the engine lists 'tiny', not 'nope'",
    }
    assert doc["metrics"] is None and doc["engine_version"] is None


def test_check_human_output_for_llamacpp(engine: HTTPServer) -> None:
    llamacpp_10798(engine)
    code, out = invoke(
        "check", "--engine", "llamacpp", "--base-url", engine.url_for("/"), "--model", "tiny"
    )
    assert code == 0, out
    assert "engine version: b10798" in out
    assert "capacity total_slots: 2" in out
    assert "capacity notes: kv_cache_tokens is n_ctx per slot x total_slots\n" in out
    assert "metrics slot_usage_ratio: 1.0" in out


def test_api_key_env_is_sent(engine: HTTPServer) -> None:
    vllm_031(engine)
    code, _ = invoke(
        "check",
        "--engine",
        "vllm",
        "--base-url",
        engine.url_for("/"),
        "--model",
        "tiny",
        "--api-key-env",
        "MY_ENGINE_KEY",
        env={"MY_ENGINE_KEY": "k-123"},
    )
    assert code == 0
    assert {r.headers.get("Authorization") for r, _ in engine.log} == {"Bearer k-123"}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--label", "novalue"], "K=V"),
        (["--router"], "llamacpp only"),
        (["--api-key-env", "CANOPYX_TEST_UNSET_VARIABLE"], "not set"),
    ],
)
def test_bad_options_exit_2_with_a_message(extra: list[str], message: str) -> None:
    code, out = invoke(
        "check", "--engine", "vllm", "--base-url", "http://127.0.0.1:9", "--model", "m", *extra
    )
    assert code == 2
    assert message in out


def test_version_prints_the_installed_version() -> None:
    code, out = invoke("--version")
    assert code == 0
    assert out == f"canopyx-provider {version('canopyx')}\n"


def test_watch_prints_the_snapshot_and_its_age(engine: HTTPServer) -> None:
    llamacpp_10798(engine)
    code, out = invoke(
        "watch",
        "--engine",
        "llamacpp",
        "--base-url",
        engine.url_for("/"),
        "--model",
        "tiny",
        "--count",
        "2",
        "--poll-interval-ms",
        "50",
    )
    assert code == 0, out
    assert out.count("│ running_requests ") == 2
    assert "age" in out and "b10798" in out


def test_watch_shows_a_failed_engine_without_figures() -> None:
    code, out = invoke(
        "watch",
        "--engine",
        "vllm",
        "--base-url",
        "http://127.0.0.1:9",
        "--model",
        "m",
        "--count",
        "1",
    )
    assert code == 0
    assert "failed" in out and "metrics unusable" in out
    assert "│ running_requests " not in out


def test_simulate_quotes_against_an_engine(engine: HTTPServer) -> None:
    llamacpp_10798(engine)  # both slots busy: every quote must be declined
    code, out = invoke(
        "simulate",
        "--engine",
        "llamacpp",
        "--base-url",
        engine.url_for("/"),
        "--model",
        "tiny",
        "--quotes",
        "3",
        "--rate",
        "100",
    )
    assert code == 0, out
    assert out.count("decline (over_target)") == 3


def test_simulate_prices_an_idle_engine(engine: HTTPServer) -> None:
    vllm_031(engine)
    code, out = invoke(
        "simulate",
        "--engine",
        "vllm",
        "--base-url",
        engine.url_for("/"),
        "--model",
        "tiny",
        "--quotes",
        "2",
        "--rate",
        "100",
    )
    assert code == 0, out
    assert out.count("$/Mtok") == 2


def test_simulate_stops_when_startup_fails() -> None:
    code, out = invoke(
        "simulate",
        "--engine",
        "vllm",
        "--base-url",
        "http://127.0.0.1:9",
        "--model",
        "m",
    )
    assert code == 1
    assert "startup checks failed" in out
