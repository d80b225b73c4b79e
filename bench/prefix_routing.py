"""Prefix routing on real engines: capyctl-gateway with prefix routing and with least load, beside
vllm-router with ``cache_aware`` and ``round_robin``, in front of the same llama-server (or vLLM)
instances, on a workload of tenants with long system prompts and growing multi-turn chats.

Each target gets freshly started engines (cold caches) and the same seeded schedule, sent open
loop at a fixed rate: every request is a stream with ``max_tokens`` 8 and usage, timed from
sending to its first generated text (TTFT). The engines' own figures say how much of each prompt
they found cached (``usage.prompt_tokens_details.cached_tokens`` over ``prompt_tokens``).

The model is the tests' random-weight llama GGUF at a larger size (n_embd 128, 4 layers, n_ff
512; about 2 MB): a 2,000-token prefill costs about 260 ms on one core here and a cached one
about 40 ms. Each llama-server runs with ``--parallel 2 -t 1 -c 16384``; with ``--cache-ram 0``
only its two slots hold prompts (as GPU memory bounds a KV cache), with the default (8 GiB of
host RAM) it also keeps prompts it evicted from a slot, which serves every tenant on every
instance whatever the routing. Both are run. A second workload with no shared prefix (every
prompt unique) checks that prefix routing loses nothing where there is nothing to win.

With ``--engine vllm`` the instances are vLLM 0.31.0 CPU servers (the tests' install), each
bound to its own core, serving the tests' tiny Llama, their KV caches bounded to
``--kv-blocks`` blocks of 128 tokens (``--num-gpu-blocks-override``; ``all`` for the 1 GiB the
tests give, which holds every prompt here).

Run: .venv/bin/python -m bench.prefix_routing [--engine vllm] [--instances 2] [--rate 4]
[--duration 30] [--out FILE]. vllm-router is looked up as bench.perf does
(``$VLLM_ROUTER_BIN``, PATH, or /tmp/vllm-router-venv); without it its rows are skipped and the
report says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from contract.engines.llamacpp import ensure_llama_server
from contract.engines.tiny_gguf import write_tiny_gguf
from contract.engines.tiny_hf_model import write_tiny_llama
from contract.engines.vllm import VllmServer, engine_dir, ensure_vllm

from bench.perf._procs import ProcessSet, free_port
from bench.perf.run import _peer_bin, start_gateway, start_peer

MODEL_SIZE = (128, 4, 512)
WORDS = [
    "ledger", "refund", "invoice", "parcel", "courier", "warranty", "dispute", "tariff",
    "rebate", "voucher", "audit", "escrow", "balance", "statement", "receipt", "courier",
    "customs", "freight",
]  # fmt: skip


@dataclass
class Result:
    target: str
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    errors: int = 0
    window_s: float = 0.0

    def row(self) -> dict[str, Any]:
        t = sorted(self.ttft_s)
        n = len(t)
        return {
            "target": self.target,
            "requests": n,
            "errors": self.errors,
            "ttft_p50_ms": round(statistics.median(t) * 1000, 1) if n else None,
            "ttft_p95_ms": round(t[min(n - 1, int(n * 0.95))] * 1000, 1) if n else None,
            "throughput_rps": round(n / self.window_s, 2) if self.window_s else None,
            "engine_hit_rate": round(self.cached_tokens / self.prompt_tokens, 3)
            if self.prompt_tokens
            else None,
        }


def system_prompt(rng: random.Random, tenant: int) -> str:
    """About 2,000 tokens of the tiny model's tokenizer (about 3 KB of text)."""
    words = [rng.choice(WORDS) for _ in range(420)]
    return f"Tenant {tenant}. You answer for desk {tenant}. " + " ".join(words)


def schedule(seed: int, n: int, tenants: int, shared: bool) -> list[list[dict[str, str]]]:
    """``n`` requests' messages: each a tenant's conversation (three per tenant) one turn on,
    its history growing to eight turns and then begun again; or, unshared, a unique prompt."""
    rng = random.Random(seed)
    systems = [system_prompt(rng, t) for t in range(tenants)]
    chats: dict[tuple[int, int], list[dict[str, str]]] = {}
    out = []
    for i in range(n):
        if not shared:
            unique = f"Request {i}. " + " ".join(rng.choice(WORDS) for _ in range(420))
            out.append([{"role": "system", "content": unique}, {"role": "user", "content": "go"}])
            continue
        key = (rng.randrange(tenants), rng.randrange(3))
        history = chats.setdefault(key, [])
        if len(history) >= 16:
            history.clear()
        history.append({"role": "user", "content": f"Question {i}: " + rng.choice(WORDS)})
        out.append([{"role": "system", "content": systems[key[0]]}, *history])
        history.append({"role": "assistant", "content": "Noted; " + " ".join(WORDS[:12])})
    return out


async def one(c: httpx.AsyncClient, url: str, model: str, msgs: Any, res: Result) -> None:
    body = {
        "model": model,
        "messages": msgs,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = None
    try:
        async with c.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.errors += 1
                await r.aread()
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                choices = chunk.get("choices") or []
                if first is None and any((ch.get("delta") or {}).get("content") for ch in choices):
                    first = time.perf_counter() - sent
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens += usage.get("prompt_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens += details.get("cached_tokens", 0)
    except httpx.HTTPError:
        res.errors += 1
        return
    if first is None:
        res.errors += 1
    else:
        res.ttft_s.append(first)


async def drive(
    target: str, url: str, key: str | None, model: str, work: list[Any], rate: float
) -> Result:
    res = Result(target)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(headers=headers, timeout=120) as c:
        start = time.perf_counter()
        tasks = []
        for i, msgs in enumerate(work):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the open loop's own pace
            tasks.append(
                asyncio.create_task(one(c, f"{url}/v1/chat/completions", model, msgs, res))
            )
        await asyncio.gather(*tasks)
        res.window_s = time.perf_counter() - start
    return res


def start_llama(
    procs: ProcessSet, binary: Path, model: Path, n: int, cache_ram: str | None
) -> list[str]:
    urls = []
    for k in range(n):
        port = free_port()
        argv = [
            str(binary),
            "-m",
            str(model),
            "-a",
            "tiny",
            "-c",
            "16384",
            "--parallel",
            "2",
            "-t",
            "1",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics",
        ]
        if cache_ram is not None:
            argv += ["--cache-ram", cache_ram]
        proc = procs.start(f"engine-{k}", argv)
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout_s=60)
        urls.append(f"http://127.0.0.1:{port}")
    return urls


def start_vllm(
    stack: ExitStack, python: Path, model: Path, n: int, blocks: str | None
) -> list[str]:
    """``n`` vLLM CPU servers, each bound to its own core (``VLLM_CPU_OMP_THREADS_BIND``; with
    more servers than cores, none bound and one thread each), with
    ``blocks`` KV blocks of 128 tokens (``--num-gpu-blocks-override``: a bounded cache, as GPU
    memory makes it), or with None the 1 GiB the tests give (a million tokens of this model)."""
    extra = ["--max-num-seqs", "4"]
    if blocks is not None:
        extra += ["--num-gpu-blocks-override", blocks]
    cores = os.cpu_count() or 1
    servers = [
        VllmServer(
            python,
            model,
            max_model_len=6144,  # what a prompt here needs; a cache of 49 blocks holds one
            extra_args=extra,
            # one core each where there are enough; else unbound, one thread each (as the
            # llama-servers' -t 1), for the kernel to spread
            extra_env={"VLLM_CPU_OMP_THREADS_BIND": str(k)}
            if n <= cores
            else {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"},
        )
        for k in range(n)
    ]
    for server in servers:
        stack.callback(server.stop)
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(VllmServer.start, servers))
    return [server.base_url for server in servers]


@dataclass(frozen=True)
class Engine:
    """Which engine the instances run: ``binary`` is llama-server, or vLLM's venv python."""

    kind: str
    binary: Path
    model: Path

    @property
    def version(self) -> str:
        return "b10798" if self.kind == "llamacpp" else "0.31.0"

    @property
    def served(self) -> str:
        return "tiny"

    def start(self, procs: ProcessSet, stack: ExitStack, n: int, cache: str | None) -> list[str]:
        if self.kind == "llamacpp":
            return start_llama(procs, self.binary, self.model, n, cache)
        return start_vllm(stack, self.binary, self.model, n, cache)


def run_target(
    name: str,
    args: argparse.Namespace,
    work: list[Any],
    cache: str | None,
    engine: Engine,
    tmp: Path,
) -> dict[str, Any]:
    procs = ProcessSet(tmp)
    with ExitStack() as stack:
        stack.callback(procs.stop_all)
        urls = engine.start(procs, stack, args.instances, cache)
        key: str | None = None
        served = engine.served
        if name.startswith("gateway"):
            policy = "prefix" if name.startswith("gateway-prefix") else "least_load"
            extra = "".join(f"      - url: {u}\n" for u in urls[1:])
            extra += f"    routing:\n      policy: {policy}\n"
            if "-margin" in name:
                extra += f"      load_margin: {name.rsplit('-margin', 1)[1]}\n"
            _, t = start_gateway(
                procs,
                tmp / name,
                urls[0],
                engine=engine.kind,
                engine_version=engine.version,
                extra=extra,
            )
            url, key, served = t.url, t.key, t.model
        else:
            peer = _peer_bin(None)
            assert peer is not None
            policy = name.removeprefix("vllm-router-")
            url = start_peer(procs, peer, *urls, policy=policy).url
        res = asyncio.run(drive(name, url, key, served, work, args.rate))
        return res.row()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second, open loop")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of requests per run")
    p.add_argument("--seed", type=int, default=20261204)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--margins",
        type=int,
        nargs="*",
        default=[1],
        help="also run prefix routing with these routing.load_margin values (default: 1)",
    )
    p.add_argument(
        "--targets", nargs="*", default=None, help="run only these targets (names as reported)"
    )
    p.add_argument(
        "--cache-ram",
        choices=["both", "0", "default"],
        default="both",
        help="which llama-server --cache-ram settings to run the shared workload with",
    )
    p.add_argument(
        "--kv-blocks",
        nargs="*",
        default=["80"],
        help="vLLM: KV blocks of 128 tokens per instance to run with ('all': its 1 GiB)",
    )
    p.add_argument("--engine", choices=["llamacpp", "vllm"], default="llamacpp")
    p.add_argument("--no-unshared", action="store_true", help="skip the no-shared-prefix workload")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="prefix-bench-"))
    if args.engine == "llamacpp":
        model = write_tiny_gguf(tmp / "model.gguf", seed=0, context_length=65536, size=MODEL_SIZE)
        engine = Engine("llamacpp", ensure_llama_server(), model)
        shared_settings: tuple[str | None, ...] = {
            "both": ("0", None),
            "0": ("0",),
            "default": (None,),
        }[args.cache_ram]
    else:
        python = ensure_vllm()
        model = write_tiny_llama(engine_dir() / "tiny-llama", python=python)
        engine = Engine("vllm", python, model)
        shared_settings = tuple(None if b == "all" else b for b in args.kv_blocks)
    n = int(args.rate * args.duration)
    targets = ["gateway-prefix", "gateway-least_load"]
    targets[1:1] = [f"gateway-prefix-margin{m}" for m in args.margins]
    if _peer_bin(None) is not None:
        targets += ["vllm-router-cache_aware", "vllm-router-round_robin"]
    else:
        print("vllm-router not found: its rows are skipped", file=sys.stderr)
    if args.targets is not None:
        targets = [t for t in targets if t in args.targets]
    rows: list[dict[str, Any]] = []
    workloads = [("shared prefixes", True)] + (
        [] if args.no_unshared else [("no shared prefix", False)]
    )
    for workload, shared in workloads:
        work = schedule(args.seed, n, args.tenants, shared)
        settings = shared_settings if shared else shared_settings[:1]
        unshared = [t for t in targets if t in ("gateway-prefix", "gateway-least_load")]
        for cache in settings:
            for name in targets if shared else unshared:
                row = run_target(name, args, work, cache, engine, tmp)
                row |= {
                    "workload": workload,
                    "engine": engine.kind,
                    "cache": describe(engine, cache),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    doc = {
        "instances": args.instances,
        "tenants": args.tenants,
        "rate": args.rate,
        "duration_s": args.duration,
        "seed": args.seed,
        "engine": args.engine,
        "model": "tiny GGUF " + str(MODEL_SIZE) if args.engine == "llamacpp" else "tiny HF llama",
        "rows": rows,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(markdown(rows))


def describe(engine: Engine, cache: str | None) -> str:
    if engine.kind == "llamacpp":
        return "--cache-ram default (8 GiB)" if cache is None else f"--cache-ram {cache}"
    return "KV 1 GiB" if cache is None else f"KV {cache} x 128 tokens"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | cache | target | TTFT p50 ms | TTFT p95 ms | req/s | "
        "engine hit rate | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['workload']} | {r.get('cache', r.get('cache_ram'))} | {r['target']} | "
        f"{r['ttft_p50_ms']} | "
        f"{r['ttft_p95_ms']} | {r['throughput_rps']} | {r['engine_hit_rate']} | {r['errors']} |"
        for r in rows
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
