"""The llama.cpp adapter against a real ``llama-server`` (build 10798) on this machine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import httpx
import pytest

from canopyx_provider import Collector, EngineSnapshot, ProviderOptions, llama_cpp
from canopyx_provider._prom import parse_samples
from canopyx_provider.adapters._llamacpp import _POLLED
from capyctl_gateway._engines import FACTS, EngineKind
from contract.engines.llamacpp import LlamaServer
from contract.live import streamed_chunks

pytestmark = pytest.mark.anyio
OPTIONS = ProviderOptions(poll_interval_ms=100, connect_attempts=1)


async def test_startup_checks_pass_with_slots_and_build(llama_server: LlamaServer) -> None:
    async with Collector(options=OPTIONS) as c:
        c.add("e", llama_cpp(llama_server.base_url), model_id="tiny", poll=False)
        report = await c.check("e")
    assert report.ok, report.checks
    assert report.engine_version == "b10798"
    assert report.capacity is not None and report.capacity.total_slots == 2
    assert report.metrics is not None and report.metrics.running_requests == 0


async def test_every_metric_the_adapter_reads_exists_once_without_labels(
    llama_server: LlamaServer,
) -> None:
    async with httpx.AsyncClient() as client:
        resp = await client.get(llama_server.base_url + "/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "process-start-time-unix" in resp.headers
    found = parse_samples(resp.text, _POLLED)
    for name in _POLLED:
        assert len(found[name]) == 1, name
        assert dict(found[name][0].labels) == {}, name


@asynccontextmanager
async def long_streams(base_url: str, n: int) -> AsyncIterator[None]:
    """``n`` streamed generations that run until the block exits and hangs up on them."""
    started = anyio.Event()
    begun = 0

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal begun
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 30000,
            "stream": True,
        }
        async with client.stream("POST", base_url + "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_lines():
                begun += 1
                if begun >= n:
                    started.set()

    async with httpx.AsyncClient(timeout=60) as client, anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(one, client)
        await started.wait()
        yield
        tg.cancel_scope.cancel()  # the clients hang up mid-stream


async def wait_for(
    c: Collector, key: str, predicate: object, *, within: float = 30
) -> EngineSnapshot:
    """Refresh until the engine's own figures satisfy ``predicate``; fail after ``within`` s."""
    with anyio.fail_after(within):
        while True:
            snap = await c.refresh(key)
            if snap is not None and predicate(snap):  # type: ignore[operator]
                return snap
            await anyio.sleep(0.1)  # the engine's own pace: llama.cpp updates as it decodes


async def test_running_rises_under_load_and_returns_to_zero_after_hang_up(
    llama_server: LlamaServer,
) -> None:
    async with Collector(options=OPTIONS) as c:
        c.add("e", llama_cpp(llama_server.base_url), model_id="tiny", poll=False)
        assert (await c.check("e")).ok
        async with long_streams(llama_server.base_url, 2):
            busy = await wait_for(c, "e", lambda s: s.metrics.running_requests == 2)
            assert busy.metrics.slot_usage_ratio == 1.0
        idle = await wait_for(c, "e", lambda s: s.metrics.running_requests == 0, within=5)
    assert idle.metrics.waiting_requests == 0
    assert idle.metrics.slot_usage_ratio == 0.0
    assert idle.metrics.generated_tokens_total is not None
    assert idle.metrics.generated_tokens_total < 2 * 30000  # stopped long before max_tokens


async def test_router_mode_reads_a_loaded_model_and_never_loads_another(
    llama_router: LlamaServer,
) -> None:
    base = llama_router.base_url
    async with httpx.AsyncClient(timeout=30) as client:
        # Load tiny-a the way a user would: by asking it something.
        chat = {"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert (await client.post(base + "/v1/chat/completions", json=chat)).status_code == 200
        async with Collector(options=OPTIONS) as c:
            c.add("a", llama_cpp(base, router=True), model_id="tiny-a", poll=False)
            c.add("b", llama_cpp(base, router=True), model_id="tiny-b", poll=False)
            a, b = await c.check("a"), await c.check("b")
            await c.refresh("b")
        models = (await client.get(base + "/v1/models")).json()["data"]
    assert a.ok, a.checks
    assert a.capacity is not None and a.capacity.total_slots == 2
    assert b.failed is not None and b.failed.name == "discovery"
    assert "not loaded" in (b.failed.reason or "")
    status = {m["id"]: m["status"]["value"] for m in models}
    assert status["tiny-b"] == "unloaded"  # checking it did not make the router load it
    assert status["tiny-a"] == "loaded"


async def test_streamed_chunk_fields(llama_server: LlamaServer) -> None:
    """The field set the gateway's verifier allows for llama.cpp, read off the real server."""
    chunks = await streamed_chunks(llama_server.base_url)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    delta_keys = {k for c in chunks for ch in c["choices"] for k in ch["delta"]}
    assert delta_keys <= FACTS[EngineKind.LLAMACPP].delta_keys
    beside = {k for c in chunks for ch in c["choices"] for k in ch} - {"delta"}
    assert beside <= {"index", "finish_reason", "logprobs"}
    assert {c["system_fingerprint"] for c in chunks} == {"b10798-unknown"}
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert set(usage_chunk["usage"]) >= {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert "cached_tokens" in usage_chunk["usage"]["prompt_tokens_details"]
    assert {"prompt_ms", "predicted_per_second", "predicted_n"} <= set(usage_chunk["timings"])
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finish] == ["length"]
