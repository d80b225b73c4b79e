"""Warm wake on a real llama-server (b10798): time to first token of the first request after a
wake, with the gateway's warm cache on and off, on the same machine in the same run.

The model is the tests' random-weight llama GGUF, wider and deeper (n_embd 192, 6 layers, n_ff
768; about 14 MB): a prefill of the 8,000-token system prompt below costs about 9 s on this
machine's 2 cores. llama-server runs ``-c 24576 --parallel 2 -t 2`` (12,288 tokens a slot),
launched by the gateway itself; every run gets a fresh state directory.

Scenarios, each run with ``lifecycle.warm_cache`` on and off:

- ``park``: a request with the system prompt fills the cache; an operator's park (a stop, for
  a one-model llama-server); the next request, sharing the system prompt, wakes it.
- ``switch``: two deployments under a memory budget that fits one; the second's request
  switches the first out, and the first's next request switches it back in.
- ``crash``: filled, parked (saved), woken; the engine is killed (SIGKILL); the next request
  restarts it, with what the park saved.
- ``unshared``: filled and parked; the next request shares nothing with what was saved (the
  restore is wasted work): it should be no slower than cold.

Every request streams with ``max_tokens`` 4 and is timed from sending to its first content
(TTFT: the engine's start, the restore and the prefill included). The fill request of each run
is the first ever on an empty state directory: with the feature on it finds nothing saved, so
on and off compare the cost of looking.

Run: .venv/bin/python -m bench.warm_wake [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web
from contract.engines.llamacpp import ensure_llama_server
from contract.engines.tiny_gguf import write_tiny_gguf
from contract.live import gone

from capyctl_gateway import GATEWAY_KEY, Gateway, GatewayConfig, GatewayRunner, create_app
from capyctl_gateway._lifecycle.operator import operator_park
from capyctl_gateway._management.status import deployment_status

MODEL_SIZE = (192, 6, 768)
KEY = "bench-" + "k" * 40
WORDS = [
    "ledger", "refund", "invoice", "parcel", "courier", "warranty", "dispute", "tariff",
    "rebate", "voucher", "audit", "escrow", "balance", "statement", "receipt", "customs",
]  # fmt: skip
SCENARIOS = ("park", "switch", "crash", "unshared")


def prompt(seed: int, words: int = 1450) -> str:
    """About 8,000 tokens of the tiny model's tokenizer."""
    rng = random.Random(seed)
    return "You answer for the desk. " + " ".join(rng.choice(WORDS) for _ in range(words))


def deployment(name: str, binary: Path, model: Path, warm: bool) -> dict[str, Any]:
    command = [str(binary), "-m", str(model), "-a", "tiny", "-c", "24576", "--parallel", "2"]
    command += ["-t", "2"]
    return {
        "name": name,
        "engine": "llamacpp",
        "engine_version": "b10798",
        "served_model": "tiny",
        "memory": {"ready": "1GiB"},
        "lifecycle": {"warm_cache": warm},
        "instances": [{"launch": {"command": command, "startup_timeout": "120s"}}],
    }


@asynccontextmanager
async def gateway(config: dict[str, Any], state: Path) -> AsyncIterator[tuple[Gateway, str]]:
    app = create_app(GatewayConfig.model_validate(config), KEY, env={}, state_dir=state)
    runner = GatewayRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield app[GATEWAY_KEY], f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def ttft(url: str, model: str, system: str, question: str) -> tuple[float, int, int]:
    """Seconds to the first content, prompt tokens, cached tokens (the engine's counts)."""
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first, tokens, cached = None, 0, 0
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(headers=headers, timeout=600) as c:
        sent = time.perf_counter()
        async with c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                choices = chunk.get("choices") or []
                if first is None and any((ch.get("delta") or {}).get("content") for ch in choices):
                    first = time.perf_counter() - sent
                usage = chunk.get("usage")
                if usage:
                    tokens = usage.get("prompt_tokens", 0)
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if first is None:
        raise RuntimeError("no content")
    return first, tokens, cached


def engine_pid(gw: Gateway, name: str) -> int:
    doc = deployment_status(gw.fleet, name)
    assert doc is not None
    return int(doc["instances"][0]["process"]["pid"])


async def run(scenario: str, warm: bool, binary: Path, model: Path, work: Path) -> dict[str, Any]:
    """One run of ``scenario``: the fill's figures and the measured request's."""
    system, other = prompt(1), prompt(2)
    deps = [deployment("a", binary, model, warm)]
    if scenario == "switch":
        deps.append(deployment("b", binary, model, warm))
    config = {"resources": {"memory_budget": "1GiB"}, "deployments": deps}
    state = Path(tempfile.mkdtemp(prefix=f"warm-{scenario}-", dir=work))
    async with gateway(config, state) as (gw, url):
        fill = await ttft(url, "a", system, "first question")
        asked_with = system
        if scenario == "switch":
            await ttft(url, "b", "Another desk entirely.", "hello")  # switches a out
        else:
            await operator_park(gw.fleet.lifecycle, "a", known=True)
        if scenario == "crash":
            await ttft(url, "a", system, "second question")  # woken (and restored)
            pid = engine_pid(gw, "a")
            os.kill(pid, signal.SIGKILL)
            assert await asyncio.to_thread(gone, pid)
        if scenario == "unshared":
            asked_with = other
        measured = await ttft(url, "a", asked_with, "the question after")
        warm_doc = deployment_status(gw.fleet, "a")
    restore = (warm_doc or {}).get("instances", [{}])[0].get("warm_cache", {}).get("last_restore")
    return {
        "scenario": scenario,
        "warm_cache": warm,
        "fill_ttft_s": round(fill[0], 3),
        "ttft_s": round(measured[0], 3),
        "prompt_tokens": measured[1],
        "cached_tokens": measured[2],
        "restore": restore,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for scenario in SCENARIOS:
        pair = {}
        for warm in (True, False):
            mine = [r for r in rows if r["scenario"] == scenario and r["warm_cache"] is warm]
            if mine:
                pair[warm] = (
                    statistics.median(r["ttft_s"] for r in mine),
                    statistics.median(r["fill_ttft_s"] for r in mine),
                    statistics.median(r["cached_tokens"] for r in mine),
                )
        if len(pair) == 2:
            on, off = pair[True], pair[False]
            out.append(
                {
                    "scenario": scenario,
                    "ttft_on_s": on[0],
                    "ttft_off_s": off[0],
                    "speedup": round(off[0] / on[0], 1) if on[0] else None,
                    "cached_on": on[2],
                    "cached_off": off[2],
                    "fill_on_s": on[1],
                    "fill_off_s": off[1],
                }
            )
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    binary = ensure_llama_server()
    work = Path(tempfile.mkdtemp(prefix="warm-wake-"))
    model = write_tiny_gguf(work / "model.gguf", seed=0, context_length=65536, size=MODEL_SIZE)
    rows = []
    for n in range(args.rounds):
        for scenario in args.scenarios:
            for warm in (True, False) if n % 2 == 0 else (False, True):  # alternate the order
                row = await run(scenario, warm, binary, model, work)
                row["round"] = n
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores",
        "engine": "llama-server b10798",
        "model_size": MODEL_SIZE,
        "model_bytes": model.stat().st_size,
        "rounds": args.rounds,
        "runs": rows,
        "summary": summary(rows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    doc = asyncio.run(main_async(args))
    text = json.dumps(doc, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    for row in doc["summary"]:
        on, off = row["ttft_on_s"], row["ttft_off_s"]
        print(
            f"{row['scenario']:9} TTFT warm {on:.3f} s, cold {off:.3f} s ({row['speedup']}x);"
            f" cached {row['cached_on']} vs {row['cached_off']} tokens;"
            f" first-ever fill {row['fill_on_s']:.3f} vs {row['fill_off_s']:.3f} s"
        )


if __name__ == "__main__":
    main()
