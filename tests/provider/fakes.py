"""Engines played from recordings on a real loopback server (pytest-httpserver)."""

from __future__ import annotations

from pytest_httpserver import HTTPServer

from tests.conftest import serve


def vllm_031(server: HTTPServer, *, metrics: str = "vllm/0.31.0/GET_metrics_idle.http") -> None:
    serve(server, "/health", "vllm/0.32.0/GET_health.http")
    serve(server, "/version", "vllm/0.31.0/GET_version.http")
    serve(server, "/v1/models", "vllm/0.31.0/GET_v1_models.http")
    serve(server, "/metrics", metrics)


def llamacpp_10798(server: HTTPServer, *, props: bool = True) -> None:
    serve(server, "/health", "llamacpp/b10798/GET_health.http")
    serve(server, "/v1/models", "llamacpp/b10798/GET_v1_models.http")
    serve(server, "/metrics", "llamacpp/b10798/GET_metrics_busy_2_generating.http")
    if props:
        serve(server, "/props", "llamacpp/b10798/GET_props.http")


def sglang_0521(server: HTTPServer) -> None:
    serve(server, "/health", "sglang/0.5.21/GET_health.http")
    serve(server, "/v1/models", "sglang/0.5.21/GET_v1_models.http")
    serve(server, "/metrics", "sglang/0.5.21/GET_metrics.http")
    serve(server, "/server_info", "sglang/0.5.21/GET_server_info.http")
