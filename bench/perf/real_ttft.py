"""Time to first token in front of a real llama-server: direct, through capyctl-gateway and,
where installed, through vllm-router; the three interleaved request by request, at
concurrency 1, so the engine's own drift falls on all of them alike.

Uses the llama-server build the test setup caches (``python -m contract.engines.llamacpp
build``) and the tests' tiny generated model. Each request opens its connection before the
clock starts (llama-server closes its connection after every stream, so the gateway and the
router connect afresh to it each time too) and times from its first byte sent to the first
chunk with generated text; the stream is read to ``data: [DONE]``.

Run from the repository root:
``.venv/bin/python -m bench.perf.real_ttft [--requests 60] [--runs 3] [--tokens 16]``.
It prints a markdown table and, with ``--json FILE``, every sample. ``--profile`` runs the
gateway under cProfile (``serve --profile FILE`` is not a gateway option: the gateway is
started as ``python -m cProfile``) and prints its hottest functions.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import orjson
from contract.engines.llamacpp import LlamaServer, ensure_llama_server
from contract.engines.tiny_gguf import write_tiny_gguf

from ._loads import Target
from ._procfs import cpu_seconds
from ._procs import ProcessSet, StartupError
from .ab import gateway_from_tree
from .run import _check_target, _peer_bin, start_gateway, start_peer

__all__ = ["main"]

CONTENT = b'"content":"'


async def one(target: Target, tokens: int) -> float:
    """One streamed request; milliseconds from its first byte sent to the first content."""
    parts = urlsplit(target.url)
    body = orjson.dumps(
        {
            "model": target.model,
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": tokens,
            "stream": True,
        }
    )
    head = [
        "POST /v1/chat/completions HTTP/1.1",
        f"Host: {parts.netloc}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if target.key:
        head.append(f"Authorization: Bearer {target.key}")
    raw = ("\r\n".join(head) + "\r\n\r\n").encode() + body
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        t0 = time.perf_counter()
        writer.write(raw)
        seen = b""
        first: float | None = None
        while True:
            data = await reader.read(65536)
            if not data:
                break
            seen += data
            if first is None and _has_text(seen):
                first = time.perf_counter()
            if b"data: [DONE]" in seen:
                break
        if first is None or b" 200 " not in seen.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"{target.name}: no content: {seen[:300]!r}")
        return (first - t0) * 1000
    finally:
        writer.close()


def _has_text(seen: bytes) -> bool:
    at = seen.find(CONTENT)
    while at >= 0:
        if seen[at + len(CONTENT) : at + len(CONTENT) + 1] != b'"':  # not empty
            return True
        at = seen.find(CONTENT, at + 1)
    return False


async def interleaved(targets: list[Target], requests: int, tokens: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {t.name: [] for t in targets}
    for _ in range(5):  # warm-up, not counted
        for t in targets:
            await one(t, tokens)
    for i in range(requests):
        order = targets[i % len(targets) :] + targets[: i % len(targets)]  # rotate who goes first
        for t in order:
            out[t.name].append(await one(t, tokens))
    return out


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.real_ttft", description=__doc__)
    parser.add_argument("--requests", type=int, default=60, help="per target per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--peer-bin", default=None)
    parser.add_argument("--profile", type=Path, default=None, help="cProfile the gateway here")
    parser.add_argument("--gateway-arg", action="append", default=[], help="more serve options")
    parser.add_argument(
        "--base", default=None, help="a second gateway from this source tree (an A/B)"
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="also a gateway with this many workers (> 1)"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="capyctl-real-ttft-"))
    procs = ProcessSet(work)
    old = {s: signal.signal(s, _terminate) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    engine: LlamaServer | None = None
    runs: list[dict[str, list[float]]] = []
    try:
        model = write_tiny_gguf(work / "tiny.gguf", seed=0, context_length=4096)
        engine = LlamaServer(ensure_llama_server(), model, parallel=2, log_path=work / "engine.log")
        engine.start()
        url = engine.base_url
        targets = [Target("direct", url, "tiny", None, ())]
        _, gw = start_gateway(
            procs,
            work,
            url,
            engine="llamacpp",
            engine_version="b10798",
            args=args.gateway_arg,
            profile=args.profile,
        )
        targets.append(gw)
        if args.workers > 1:
            _, team = start_gateway(
                procs,
                work / "workers",
                url,
                engine="llamacpp",
                engine_version="b10798",
                args=[*args.gateway_arg, "--workers", str(args.workers)],
                name="workers",
            )
            targets.append(team)
        if args.base is not None:
            base = gateway_from_tree(
                procs, work / "base", url, args.base, engine="llamacpp", engine_version="b10798"
            )
            targets.append(dataclasses.replace(base, name="base"))
        peer_bin = None if args.no_peer else _peer_bin(args.peer_bin)
        if peer_bin is not None:
            targets.append(start_peer(procs, peer_bin, url))
        for t in targets[1:]:
            _check_target(t, stream=True)
        for r in range(args.runs):
            cpu0 = {t.name: cpu_seconds(t.pids) for t in targets[1:]}
            got = asyncio.run(interleaved(targets, args.requests, args.tokens))
            for t in targets[1:]:  # CPU per request, its background work (polls) included
                spent = cpu_seconds(t.pids) - cpu0[t.name]
                got[f"{t.name}_cpu_ms"] = [spent * 1000 / (args.requests + 5)]
            runs.append(got)
            line = ", ".join(f"{k} {statistics.median(v):.3f} ms" for k, v in got.items())
            print(f"run {r + 1}: median {line}", file=sys.stderr, flush=True)
    except StartupError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    finally:
        procs.stop_all()  # the gateway first writes its profile on SIGTERM
        if engine is not None:
            engine.stop()
        for s, h in old.items():
            signal.signal(s, h)
    print(_table(runs))
    if args.json is not None:
        args.json.write_bytes(orjson.dumps({"runs": runs}, option=orjson.OPT_INDENT_2))
    shutil.rmtree(work, ignore_errors=True)
    return 0


def _table(runs: list[dict[str, list[float]]]) -> str:
    rows = [
        "| run | direct TTFT p50 | gateway adds | vllm-router adds | CPU per request: gateway "
        "/ vllm-router |",
        "|---|---|---|---|---|",
    ]
    for i, got in enumerate(runs, 1):
        direct = statistics.median(got["direct"])

        def added(name: str, got: dict[str, Any] = got, direct: float = direct) -> str:
            return f"{statistics.median(got[name]) - direct:+.3f} ms" if name in got else "-"

        cpu = " / ".join(
            f"{got[k][0]:.3f} ms" if k in got else "-" for k in ("gateway_cpu_ms", "peer_cpu_ms")
        )
        rows.append(f"| {i} | {direct:.3f} ms | {added('gateway')} | {added('peer')} | {cpu} |")
        if "base" in got:
            rows.append(f"| {i}, the base tree | | {added('base')} | | |")
        if "workers" in got:
            cpu_w = f"{got['workers_cpu_ms'][0]:.3f} ms"
            rows.append(f"| {i}, with workers | | {added('workers')} | | {cpu_w} |")
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
