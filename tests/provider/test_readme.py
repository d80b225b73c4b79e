"""The README's SDK example runs as written, against a fake vLLM on a loopback port."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pytest_httpserver import HTTPServer
from werkzeug import Response

from tests.conftest import recorded, serve

README = Path(__file__).resolve().parents[2] / "README.md"
#: The engine the example names; the test points it at the fake instead.
EXAMPLE_URL = "http://127.0.0.1:8000"
EXAMPLE_MODEL = "Qwen/Qwen3-8B"


def sdk_example() -> str:
    """The one ``python`` block under the README's "Using the SDK" heading."""
    section = README.read_text(encoding="utf-8").split("## Using the SDK", 1)[1]
    blocks = re.findall(r"^```python\n(.*?)^```", section.split("\n## ", 1)[0], re.M | re.S)
    assert len(blocks) == 1, "expected one python block under 'Using the SDK'"
    code: str = blocks[0]
    return code


def serve_as(server: HTTPServer, path: str, rel: str) -> None:
    """A recording of vLLM serving ``tiny``, renamed to serve the example's model."""
    rec = recorded(rel)
    body = rec.body.replace(b'"tiny"', json.dumps(EXAMPLE_MODEL).encode())
    response = Response(body, status=rec.status, content_type=rec.headers.get("content-type"))
    server.expect_request(path).respond_with_response(response)


def test_the_readme_sdk_example_prints_the_check_report_as_json(
    engine: HTTPServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    serve(engine, "/health", "vllm/0.32.0/GET_health.http")
    serve(engine, "/version", "vllm/0.31.0/GET_version.http")
    serve_as(engine, "/v1/models", "vllm/0.31.0/GET_v1_models.http")
    serve_as(engine, "/metrics", "vllm/0.31.0/GET_metrics_idle.http")
    monkeypatch.setenv("CANOPYX_ENGINE_API_KEY", "k-readme")
    code = sdk_example()
    assert EXAMPLE_URL in code and EXAMPLE_MODEL in code
    code = code.replace(EXAMPLE_URL, engine.url_for("/").rstrip("/"))

    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})  # noqa: S102

    printed = capsys.readouterr().out
    report = json.loads(printed)  # JSON text, not a Python repr
    assert [(c["name"], c["ok"]) for c in report["checks"]] == [
        ("health", True),
        ("models", True),
        ("discovery", True),
        ("metrics", True),
    ]
    assert report["engine_version"] == "0.31.0"
    assert report["metrics"]["running_requests"] == 0
    assert {req.headers.get("Authorization") for req, _ in engine.log} == {"Bearer k-readme"}
