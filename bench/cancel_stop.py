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
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
from contract.engines._proc import free_port

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


def _gateway(
    engine: str, version: str, url: str, workdir: Path
) -> tuple[subprocess.Popen[bytes], str, str]:
    config = workdir / f"gateway-{engine}.yaml"
    config.write_text(
        f'deployments:\n  - name: bench\n    engine: {engine}\n    engine_version: "{version}"\n'
        f"    served_model: tiny\n    instances:\n      - url: {url}\n"
    )
    port, mport = free_port(), free_port()
    state = workdir / "state"
    cmd = [
        str(Path(sys.executable).with_name("capyctl-gateway")),
        "serve",
        "--config",
        str(config),
        "--listen",
        f"127.0.0.1:{port}",
        "--management",
        f"127.0.0.1:{mport}",
        "--state-dir",
        str(state),
        "--log-format",
        "json",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            httpx.get(base + "/v1/models", timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    key = (state / "identity" / "credentials").read_text().split("api_key: ")[1].split()[0]
    return proc, base, key


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default="llamacpp,vllm", help="comma-separated")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="cancel-bench-"))
    chat = {"model": "bench", "messages": [{"role": "user", "content": "count"}]}
    if "llamacpp" in args.engines:
        from contract.engines.llamacpp import LlamaServer, ensure_llama_server
        from contract.engines.tiny_gguf import write_tiny_gguf

        model = write_tiny_gguf(workdir / "tiny.gguf", context_length=262144)
        with LlamaServer(ensure_llama_server(), model, parallel=CLIENTS, ctx=262144) as srv:
            proc, base, key = _gateway("llamacpp", "b10798", srv.base_url, workdir)
            try:
                auth = {"Authorization": f"Bearer {key}"}
                for stream in (True, False):
                    kind = "streamed" if stream else "non-streamed"
                    body = {**chat, "max_tokens": 60000, "stream": stream}
                    rows.append(
                        measure(
                            f"llama.cpp b10798 via gateway, {kind}",
                            partial(
                                _run,
                                base + "/v1/chat/completions",
                                body,
                                auth,
                                llama_cpp(srv.base_url),
                                "tiny",
                            ),
                            args.repeats,
                        )
                    )
                    direct = {**body, "model": "tiny"}
                    rows.append(
                        measure(
                            f"llama.cpp b10798 direct, {kind}",
                            partial(
                                _run,
                                srv.base_url + "/v1/chat/completions",
                                direct,
                                {},
                                llama_cpp(srv.base_url),
                                "tiny",
                            ),
                            args.repeats,
                        )
                    )
            finally:
                proc.terminate()
                proc.wait(10)
    if "vllm" in args.engines:
        from contract.engines.tiny_hf_model import write_tiny_llama
        from contract.engines.vllm import VllmServer, engine_dir, ensure_vllm

        python = ensure_vllm()
        model_dir = engine_dir() / "tiny-llama"
        write_tiny_llama(model_dir, python=python)
        with VllmServer(python, model_dir, max_model_len=16384) as srv:
            proc, base, key = _gateway("vllm", "0.31.0", srv.base_url, workdir)
            try:
                auth = {"Authorization": f"Bearer {key}"}
                for stream in (True, False):
                    kind = "streamed" if stream else "non-streamed"
                    body = {**chat, "max_tokens": 12000, "ignore_eos": True, "stream": stream}
                    rows.append(
                        measure(
                            f"vLLM 0.31.0 via gateway, {kind}",
                            partial(
                                _run,
                                base + "/v1/chat/completions",
                                body,
                                auth,
                                vllm(srv.base_url),
                                "tiny",
                            ),
                            args.repeats,
                        )
                    )
                    direct = {**body, "model": "tiny"}
                    rows.append(
                        measure(
                            f"vLLM 0.31.0 direct, {kind}",
                            partial(
                                _run,
                                srv.base_url + "/v1/chat/completions",
                                direct,
                                {},
                                vllm(srv.base_url),
                                "tiny",
                            ),
                            args.repeats,
                        )
                    )
            finally:
                proc.terminate()
                proc.wait(10)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
