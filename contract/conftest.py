"""Fixtures of the contract suite: real engines, started once per test session."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from capyctl_gateway import GATEWAY_KEY, Gateway, GatewayConfig, GatewayRunner, create_app
from contract.engines.llamacpp import LlamaServer, ensure_llama_server
from contract.engines.tiny_gguf import write_tiny_gguf
from contract.engines.tiny_hf_model import write_tiny_llama
from contract.engines.vllm import VllmServer, engine_dir, ensure_vllm


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent / "live"
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.live)
        # Whichever test first asks for the session's vLLM pays its start (about 30 s, more on a
        # busy machine, with its warm-up): whatever order the tests run in, that fits.
        if "vllm_server" in getattr(item, "fixturenames", ()) and not item.get_closest_marker(
            "timeout"
        ):
            item.add_marker(pytest.mark.timeout(300))


@pytest.fixture(scope="session")
def llama_server_binary() -> Path:
    """``llama-server`` build 10798, built once into the wheel cache (minutes the first time)."""
    return ensure_llama_server()


@pytest.fixture(scope="session")
def llama_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    models = tmp_path_factory.mktemp("gguf")
    # A long context so that generations last seconds, not milliseconds.
    write_tiny_gguf(models / "tiny.gguf", seed=0, context_length=65536)
    router = models / "router"
    write_tiny_gguf(router / "tiny-a.gguf", seed=1, context_length=65536)
    write_tiny_gguf(router / "tiny-b.gguf", seed=2, context_length=65536)
    return models


@pytest.fixture(scope="session")
def llama_server(llama_server_binary: Path, llama_models: Path) -> Iterator[LlamaServer]:
    with LlamaServer(
        llama_server_binary, llama_models / "tiny.gguf", parallel=2, ctx=65536
    ) as server:
        yield server


@pytest.fixture(scope="session")
def llama_router(llama_server_binary: Path, llama_models: Path) -> Iterator[LlamaServer]:
    with LlamaServer(
        llama_server_binary, llama_models / "router", parallel=2, ctx=8192, router=True
    ) as server:
        yield server


@pytest.fixture(scope="session")
def vllm_server() -> Iterator[VllmServer]:
    """vLLM 0.31.0 (CPU build) serving a tiny random Llama as ``tiny`` (about 30 s to start)."""
    python = ensure_vllm()
    model_dir = engine_dir() / "tiny-llama"
    write_tiny_llama(model_dir, python=python)
    # A long context so that a generation lasts minutes: on 2 cores vLLM's three busy processes
    # left a test process unscheduled for 5 to 10 s at a time (measured beside two streams at
    # about 300 tokens/s each), and a CI run once let a 16,000-token stream finish before its
    # hang-up reached the engine. 64,000 tokens leave minutes of margin.
    # A tool-call parser, which vLLM asks for before it takes a named tool_choice (the call
    # itself is then constrained to the tool's schema): pythonic needs no special tokens of
    # the tokenizer (llama3_json and hermes refuse every request of the tiny model without).
    tools = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic")
    with VllmServer(python, model_dir, max_model_len=65536, extra_args=tools) as server:
        yield server


@dataclass(frozen=True)
class RunningGateway:
    url: str
    key: str
    gateway: Gateway


async def _gateway(engine: str, version: str, url: str) -> AsyncIterator[RunningGateway]:
    deployment = {
        "name": "my-model",
        "engine": engine,
        "engine_version": version,
        "served_model": "tiny",
        "instances": [{"url": url}],
    }
    async for gw in serve_gateway({"deployments": [deployment]}):
        yield gw


async def serve_gateway(config: dict[str, Any], **create: Any) -> AsyncGenerator[RunningGateway]:
    """capyctl-gateway for ``config`` on a loopback port (``create``: more of create_app's
    arguments), stopped when the iteration ends."""
    key = "live-" + "k" * 40
    app = create_app(GatewayConfig.model_validate(config), key, env={}, **create)
    runner = GatewayRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield RunningGateway(f"http://{host}:{port}", key, app[GATEWAY_KEY])
    finally:
        await runner.cleanup()


@pytest.fixture
async def llama_gateway(llama_server: LlamaServer) -> AsyncIterator[RunningGateway]:
    """capyctl-gateway in front of the real llama-server, deployment ``my-model``."""
    async for gw in _gateway("llamacpp", "b10798", llama_server.base_url):
        yield gw


@pytest.fixture
async def vllm_gateway(vllm_server: VllmServer) -> AsyncIterator[RunningGateway]:
    """capyctl-gateway in front of the real vLLM server, deployment ``my-model``."""
    async for gw in _gateway("vllm", "0.31.0", vllm_server.base_url):
        yield gw


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record",
        action="store_true",
        default=False,
        help="live tier: rewrite contract/recorded/ from the real engines instead of checking "
        "the recordings' shapes against them",
    )


@pytest.fixture(scope="session")
def record(request: pytest.FixtureRequest) -> bool:
    """True under ``--record``: the live tier rewrites the recordings it would otherwise check."""
    return bool(request.config.getoption("--record"))
