"""capyctl-gateway launching vLLM 0.31.0's CPU build itself: the flag the spec forces is on the
engine's command line without the operator writing it, answers carry the engine's own
figures, ``park: auto`` adds no sleep flag (the CPU build cannot sleep), and after concurrent
requests the idle clock stops it, counted from the end of the last one."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest

from capyctl_gateway._management.status import deployment_status
from contract.conftest import RunningGateway, serve_gateway
from contract.engines.vllm import VllmServer
from contract.live import gone

pytestmark = pytest.mark.anyio
IDLE_S = 3


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def launched_vllm(vllm_server: VllmServer, tmp_path: Path) -> AsyncIterator[RunningGateway]:
    """A gateway whose deployment runs its own vLLM (the session's server lends its python,
    model and environment; it is not the one that answers)."""
    env = vllm_server.env(tmp_path / "run")
    extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
    command = [
        str(vllm_server.python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(vllm_server.model_dir), "--served-model-name", "tiny",
        "--max-model-len", "2048", "--dtype", "float32", "--enforce-eager",
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    deployment = {
        "name": "my-model",
        "engine": "vllm",
        "engine_version": "0.31.0",
        "served_model": "tiny",
        "instances": [{"launch": {"command": command, "env": extra, "startup_timeout": "300s"}}],
        "lifecycle": {"ready_idle_timeout": f"{IDLE_S}s"},
    }
    async for gw in serve_gateway({"deployments": [deployment]}, engine_logs=tmp_path / "logs"):
        yield gw


@pytest.mark.timeout(600)  # the session's vLLM may start here, then the gateway starts its own
async def test_vllm_launched_by_the_gateway_with_the_forced_flag(
    launched_vllm: RunningGateway,
) -> None:
    body: dict[str, Any] = {
        "model": "my-model",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient(timeout=300) as c:
        r = await c.post(
            launched_vllm.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {launched_vllm.key}"},
            json=body,
        )
    assert r.status_code == 200, r.text
    comment = next(line for line in r.text.splitlines() if line.startswith(": x-capyctl-metrics"))
    figures = orjson.loads(comment.split(" ", 2)[2])
    # vLLM's own per-request figures: only there because the gateway added the flag.
    assert figures["queue_ms"]["source"] == "engine"
    assert figures["prefill_ms"]["source"] == "engine"
    doc = deployment_status(launched_vllm.gateway.fleet, "my-model")
    assert doc is not None
    assert doc["deployment"]["park"] == "stop"  # the CPU build cannot sleep
    pid = doc["instances"][0]["process"]["pid"]
    cmdline = (await anyio.Path(f"/proc/{pid}/cmdline").read_bytes()).split(b"\0")
    assert b"--enable-per-request-metrics" in cmdline
    assert b"--enable-sleep-mode" not in cmdline
    assert cmdline[cmdline.index(b"--host") + 1] == b"127.0.0.1"
    # Concurrent requests, then the idle clock: it runs from the end of the last one.
    stopping: list[float] = []
    stopped = anyio.Event()

    done = anyio.Event()

    def watch(lc: Any) -> None:
        if lc.state.value == "stopping":
            stopping.append(time.monotonic())
            stopped.set()
        if lc.state.value == "stopped":
            done.set()

    launched_vllm.gateway.fleet.lifecycle.engines.observers.append(watch)
    ends: list[float] = []

    async def one(c: httpx.AsyncClient, tokens: int) -> None:
        long = {**body, "max_tokens": tokens, "stream": False}
        long.pop("stream_options")
        r = await c.post(
            launched_vllm.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {launched_vllm.key}"},
            json=long,
        )
        ends.append(time.monotonic())
        assert r.status_code == 200, r.text

    async with httpx.AsyncClient(timeout=300) as c:
        await asyncio.gather(*(one(c, tokens) for tokens in (8, 16, 32, 64)))
    assert not stopping  # not while they ran, however long since the first began
    with anyio.fail_after(60):
        await stopped.wait()
    assert stopping[0] - max(ends) >= IDLE_S - 1.0  # the watch looks once a second
    assert await anyio.to_thread.run_sync(gone, pid)
    with anyio.fail_after(60):
        await done.wait()  # the stop is over once the engine's log is drained too
    assert launched_vllm.gateway.fleet.lifecycle.lives["my-model"].state == "stopped"
