"""Prefix routing in front of two real llama-servers (``--cache-ram 0``: each keeps prompts in
its two slots only): each of three tenants' prompts go to one engine, which finds them cached by its
own count, and the gateway shows that count; with least load the same prompts spread."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.eventually import eventually

from capyctl_gateway._management.status import deployment_status
from contract.conftest import RunningGateway, serve_gateway
from contract.engines.llamacpp import LlamaServer

pytestmark = pytest.mark.anyio
TENANTS = {
    name: f"You are the {name} desk of the forest canopy survey. " * 30
    for name in ("billing", "shipping", "legal")
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def two_engines(llama_server_binary: Path, llama_models: Path) -> Iterator[list[str]]:
    servers = [
        LlamaServer(llama_server_binary, llama_models / "tiny.gguf", parallel=2, ctx=8192,
                    threads=1, extra_args=["--cache-ram", "0"])
        for _ in range(2)
    ]  # fmt: skip
    for s in servers:
        s.__enter__()
    try:
        yield [s.base_url for s in servers]
    finally:
        for s in servers:
            s.__exit__(None, None, None)


def config(urls: list[str], policy: str) -> dict[str, Any]:
    return {
        "deployments": [{
            "name": "my-model", "engine": "llamacpp", "engine_version": "b10798",
            "served_model": "tiny", "instances": [{"url": u} for u in urls],
            "routing": {"policy": policy},
        }]
    }  # fmt: skip


async def ask(c: httpx.AsyncClient, tenant: str, turn: int) -> int:
    """One chat for ``tenant``; the prompt tokens the engine found cached."""
    body = {
        "model": "my-model",
        "messages": [
            {"role": "system", "content": TENANTS[tenant]},
            {"role": "user", "content": f"Question {turn}"},
        ],
        "max_tokens": 4,
    }
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    cached: int = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def picks(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        getattr(r, "fields", {})
        for r in caplog.records
        if getattr(r, "event", None) == "router_selection"
    ]


@pytest.mark.parametrize("policy", ["prefix", "least_load"])
async def test_a_tenants_prompts_meet_their_cache_only_under_prefix_routing(
    two_engines: list[str], policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    async for gw in serve_gateway(config(two_engines, policy)):
        await scenario(gw, policy, caplog)


async def scenario(gw: RunningGateway, policy: str, caplog: pytest.LogCaptureFixture) -> None:
    fleet = gw.gateway.fleet
    route = fleet.routes["my-model"]
    await eventually(lambda: all(i.runner.sample() is not None for i in route.instances))
    headers = {"Authorization": f"Bearer {gw.key}"}
    async with httpx.AsyncClient(base_url=gw.url, headers=headers, timeout=60) as c:
        # One after another: load never outweighs the prefix.
        cached = [await ask(c, tenant, turn) for turn in range(3) for tenant in TENANTS]
    chosen = [p["instance"] for p in picks(caplog)]
    if policy == "prefix":
        # The tenants' first prompts met no cache (fresh engines, --cache-ram 0); each later one
        # found its tenant's system prompt cached on the engine its first went to.
        assert cached[:3] == [0, 0, 0], cached
        assert all(n > 200 for n in cached[3:]), cached
        for t in range(3):
            assert len(set(chosen[t::3])) == 1, chosen
        assert all(p["why"] == "prefix" for p in picks(caplog)[3:])
    else:  # the turn alternates the engines, and each tenant meets both
        for t in range(3):
            assert set(chosen[t::3]) == {0, 1}, chosen

    def counted() -> dict[str, Any] | None:
        """The status document once both engines' own counts show a hit."""
        doc = deployment_status(fleet, "my-model")
        assert doc is not None
        rows = [i.get("prefix_cache") for i in doc["instances"]]
        return doc if all(rows) and sum(r["hit_tokens"] for r in rows) else None

    doc = await eventually(counted)
    assert 0 < doc["deployment"]["prefix_cache_hit_ratio"] < 1
