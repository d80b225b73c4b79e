"""Warm wake on the real llama-server b10798, launched by the gateway: what it cached survives a
park (a stop here) and a crash, and the first request after the wake finds its system prompt in
the engine's cache (the engine's own ``cached_tokens`` says so); a model replaced in place is
never given the old model's cache, which llama-server itself would take. Timings are the
benchmark's (``bench/warm_wake.py``)."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from capyctl_gateway._lifecycle.operator import operator_park
from capyctl_gateway._management.status import deployment_status
from contract.conftest import RunningGateway, serve_gateway
from contract.engines.tiny_gguf import write_tiny_gguf
from contract.live import gone

pytestmark = pytest.mark.anyio

SIZE = (128, 4, 512)
WORDS = ["ledger", "refund", "invoice", "parcel", "courier", "warranty", "dispute", "tariff"]
SYSTEM = "You answer for the desk. " + " ".join(random.Random(7).choice(WORDS) for _ in range(700))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "models" / "wide.gguf", context_length=65536, size=SIZE)


def config(binary: Path, model: Path) -> dict[str, Any]:
    command = [str(binary), "-m", str(model), "-a", "tiny", "-c", "16384", "--parallel", "2"]
    return {
        "deployments": [
            {
                "name": "my-model",
                "engine": "llamacpp",
                "engine_version": "b10798",
                "served_model": "tiny",
                "instances": [{"launch": {"command": [*command, "-t", "2"],
                                          "startup_timeout": "120s"}}],
            }
        ]
    }  # fmt: skip


async def gateway(cfg: dict[str, Any], state: Path) -> AsyncIterator[RunningGateway]:
    async for gw in serve_gateway(cfg, state_dir=state):
        yield gw


async def cached(gw: RunningGateway, question: str) -> tuple[int, int]:
    """The engine's own counts for one answer: prompt tokens, and of those cached."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    body = {"model": "my-model", "messages": messages, "max_tokens": 2}
    async with httpx.AsyncClient(timeout=300) as c:
        r = await c.post(
            gw.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {gw.key}"},
            json=body,
        )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def engine_pid(gw: RunningGateway) -> int:
    doc = deployment_status(gw.gateway.fleet, "my-model")
    assert doc is not None
    return int(doc["instances"][0]["process"]["pid"])


async def test_llama_server_parked_and_crashed_wakes_with_its_system_prompt_cached(
    llama_server_binary: Path, model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capyctl_gateway")
    state = tmp_path / "state"
    async for gw in gateway(config(llama_server_binary, model), state):
        prompt, hit = await cached(gw, "first question")
        assert hit == 0 and prompt > 4000
        await operator_park(gw.gateway.fleet.lifecycle, "my-model", known=True)  # a stop
        slot_dir = state / "warm" / "my-model" / "0"
        (saved,) = json.loads((slot_dir / "manifest.json").read_text())["slots"]
        assert saved["tokens"] >= prompt and (slot_dir / saved["file"]).stat().st_mode & 0o077 == 0
        _, hit = await cached(gw, "second question")  # woken: restored before it was admitted
        assert hit >= prompt - 32  # all but the question and its turn (22 tokens here)
        pid = engine_pid(gw)
        os.kill(pid, signal.SIGKILL)
        assert await anyio.to_thread.run_sync(gone, pid)
        _, hit = await cached(gw, "third question")  # restarted with what the park saved
        assert hit >= prompt - 32
        doc = deployment_status(gw.gateway.fleet, "my-model")
        assert doc is not None
        assert doc["instances"][0]["warm_cache"]["last_restore"]["tokens"] == saved["tokens"]
    # each request's last selection: the third one may first go to the killed engine before the
    # gateway has seen its exit (a failover), and only the restarted one's selection is warm
    last: dict[str, str | None] = {}
    for r in caplog.records:
        if getattr(r, "event", "") == "router_selection":
            fields = getattr(r, "fields", {})
            last[fields["capyctl_request_id"]] = fields.get("warm_cache")
    lines = list(last.values())
    assert len(lines) == 3
    assert (
        lines[0] is None and lines[1] == lines[2] == f"1 prefix restored, {saved['tokens']} tokens"
    )


async def test_a_model_replaced_in_place_is_never_given_the_old_ones_cache(
    llama_server_binary: Path, model: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    async for gw in gateway(config(llama_server_binary, model), state):
        await cached(gw, "first question")
    write_tiny_gguf(model, seed=1, context_length=65536, size=SIZE)  # same shape, other weights
    async for gw in gateway(config(llama_server_binary, model), state):
        _, hit = await cached(gw, "second question")
        assert hit == 0  # llama-server would have taken the file and served from it
        doc = deployment_status(gw.gateway.fleet, "my-model")
        assert doc is not None
        row = doc["instances"][0]["warm_cache"]
        assert row["last_restore"]["failed"].startswith("saved under another model")
    assert [p.name for p in (state / "warm" / "my-model" / "0").glob("slot*")] != []  # resaved
