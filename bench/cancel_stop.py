"""How quickly a hang-up stops real engines, through capyctl-gateway (and directly, to compare).

The experiment of the gateway's spec, on this machine's CPU engines: four long generations at
once, all four clients gone once the engine reports four running (for a stream, once each client
has read generated text), then the engine's own running + waiting count read every 100 ms until
both are 0. Seconds from the hang-up to the first reading of 0; three repeats per row.

Run: .venv/bin/python -m bench.cancel_stop [--repeats 3] [--engines llamacpp,vllm] [--out FILE]
(from the repository root; the engines are built or installed on first use).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx

from bench.perf._loads import Target
from bench.perf._procs import ProcessSet
from bench.perf.run import start_gateway
from canopyx_provider import Collector, EngineAdapter, ProviderOptions, llama_cpp, vllm

CAP_S = 20.0  # give up reading after this long; reported as "> 20 s"
CLIENTS = 4


async def _engine_count(c: Collector) -> int | None:
    snap = await c.refresh("e")
    if snap is None or snap.metrics.running_requests is None:
        return None
    return snap.metrics.running_requests + (snap.metrics.waiting_requests or 0)


async def one_run(
    url: str, body: dict[str, Any], headers: dict[str, str], adapter: EngineAdapter, model: str
) -> float | None:
    """Seconds from the hang-up to the engine's first reading of 0 (None: not within CAP_S)."""
    options = ProviderOptions(request_timeout_ms=10_000, connect_attempts=1)
    async with Collector(options=options) as c:
        c.add("e", adapter, model_id=model, poll=False)
        report = await c.check("e")
        if not report.ok:
            raise SystemExit(f"engine check failed: {report.checks}")
        text_seen = [False] * CLIENTS

        async def client(i: int, http: httpx.AsyncClient) -> None:
            if body.get("stream"):
                async with http.stream("POST", url, json=body, headers=headers) as r:
                    async for line in r.aiter_lines():
                        if '"content":"' in line and '"content":""' not in line:
                            text_seen[i] = True
            else:
                await http.post(url, json=body, headers=headers)
                text_seen[i] = True

        async with httpx.AsyncClient(timeout=300) as http, anyio.create_task_group() as tg:
            for i in range(CLIENTS):
                tg.start_soon(client, i, http)
            with anyio.fail_after(120):
                while True:
                    count = await _engine_count(c)
                    streams_ready = all(text_seen) or not body.get("stream")
                    if count is not None and count >= CLIENTS and streams_ready:
                        break
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()  # every client hangs up at once
            hung_up = time.monotonic()
        while time.monotonic() - hung_up < CAP_S:
            if await _engine_count(c) == 0:
                return time.monotonic() - hung_up
            await anyio.sleep(0.1)
        return None


def _run(
    url: str, body: dict[str, Any], headers: dict[str, str], adapter: EngineAdapter, model: str
) -> float | None:
    return anyio.run(one_run, url, body, headers, adapter, model)


def measure(name: str, run: Callable[[], float | None], repeats: int) -> dict[str, Any]:
    values = [run() for _ in range(repeats)]
    got = [v for v in values if v is not None]
    row: dict[str, Any] = {
        "row": name,
        "runs": [None if v is None else round(v, 2) for v in values],
    }
    if len(got) == len(values):
        row["median_s"], row["max_s"] = round(statistics.median(got), 2), round(max(got), 2)
    print(json.dumps(row), flush=True)
    return row


def _rows(
    label: str,
    engine_url: str,
    adapter: Callable[[str], EngineAdapter],
    gateway: Target,
    body: dict[str, Any],
    repeats: int,
) -> list[dict[str, Any]]:
    """Through the gateway and directly, streamed and not: four rows for one engine."""
    rows = []
    auth = {"Authorization": f"Bearer {gateway.key}"}
    for stream in (True, False):
        kind = "streamed" if stream else "non-streamed"
        sent = {**body, "stream": stream}
        for path, url, headers, model in (
            ("via gateway", gateway.url, auth, "bench"),
            ("direct", engine_url, {}, "tiny"),
        ):
            run = partial(
                _run,
                url + "/v1/chat/completions",
                {**sent, "model": model},
                headers,
                adapter(engine_url),
                "tiny",
            )
            rows.append(measure(f"{label} {path}, {kind}", run, repeats))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default="llamacpp,vllm", help="comma-separated")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="cancel-bench-"))
    procs = ProcessSet(workdir)
    chat = {"messages": [{"role": "user", "content": "count"}]}
    try:
        if "llamacpp" in args.engines:
            from contract.engines.llamacpp import LlamaServer, ensure_llama_server
            from contract.engines.tiny_gguf import write_tiny_gguf

            model = write_tiny_gguf(workdir / "tiny.gguf", context_length=262144)
            with LlamaServer(ensure_llama_server(), model, parallel=CLIENTS, ctx=262144) as srv:
                _, target = start_gateway(
                    procs, workdir, srv.base_url, engine="llamacpp", engine_version="b10798"
                )
                body = {**chat, "max_tokens": 60000}
                rows += _rows(
                    "llama.cpp b10798", srv.base_url, llama_cpp, target, body, args.repeats
                )
                procs.stop_all()  # the gateway, before its engine stops
        if "vllm" in args.engines:
            from contract.engines.tiny_hf_model import write_tiny_llama
            from contract.engines.vllm import VllmServer, engine_dir, ensure_vllm

            python = ensure_vllm()
            model_dir = engine_dir() / "tiny-llama"
            write_tiny_llama(model_dir, python=python)
            with VllmServer(python, model_dir, max_model_len=16384) as srv:
                _, target = start_gateway(procs, workdir, srv.base_url)
                body = {**chat, "max_tokens": 12000, "ignore_eos": True}
                rows += _rows("vLLM 0.31.0", srv.base_url, vllm, target, body, args.repeats)
                procs.stop_all()  # the gateway, before its engine stops
    finally:
        procs.stop_all()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
