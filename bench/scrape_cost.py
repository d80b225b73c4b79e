"""CPU cost of collecting one real vLLM /metrics page, per HTTP client.

On the page captured live from vLLM 0.31.0 (47 KB, 582 lines), counting only the CPU of the
thread that runs the collector (``time.thread_time``); the engine is a separate process (python
http.server), so its CPU is not counted. It sets TCP_NODELAY, as vLLM's server does: without it
the end of each answer waited for the client's delayed ACK (about 20 ms per GET), and the httpx
cycle measured 2.9 ms of CPU instead of 1.5 ms.
  * parse: the adapter turning the exposition into a snapshot's metrics (pure CPU);
  * then, for each fetcher and event loop -- httpx on asyncio (the SDK's default), aiohttp on
    uvloop (what capyctl-gateway runs) and aiohttp on asyncio (an asyncio provider that opts in
    with ``fetcher=``):
      - cycle: one whole collection cycle (``Collector.refresh``: GET /health, GET /metrics,
        parse, snapshot);
      - /metrics scrape: the adapter's ``collect`` alone (GET /metrics and parse);
      - GET /metrics, GET /health: the fetcher's GET alone (a 47 KB body, an empty one).

With --live-vllm the same is measured against a real vLLM 0.31.0 server, plus GET /metrics with
the other Accept-Encoding for each client (httpx asks for gzip by default, AiohttpFetcher for
identity), to tell whether the encoding matters; the line about the live page says whether vLLM
compressed its answer to httpx's default request.

Run: .venv/bin/python bench/scrape_cost.py [--n 2000] [--rounds 5]
     .venv/bin/python bench/scrape_cost.py --n 1000 --live-vllm   # also a real vLLM 0.31.0 server
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import anyio
import httpx

from canopyx_provider import (
    AiohttpFetcher,
    Collector,
    Fetcher,
    HttpxFetcher,
    ProviderOptions,
    vllm,
)

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "contract/recorded/vllm/0.31.0/GET_metrics_idle.http"

SERVER = r"""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
files = dict(a.split("=", 1) for a in sys.argv[2:])
bodies = {path: open(f, "rb").read() for path, f in files.items()}
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # TCP_NODELAY, as asyncio servers (vLLM's uvicorn) set it
    def do_GET(self):
        body = bodies.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("content-length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")
    def log_message(self, *a): pass
s = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def body_of(path: Path) -> bytes:
    return path.read_bytes().partition(b"\r\n\r\n")[2]


def bench_parse(text: str, n: int) -> list[float]:
    adapter = vllm("http://127.0.0.1:1")
    out = []
    for _ in range(n):
        t0 = time.thread_time()
        adapter.parse_metrics(text, "tiny")
        out.append(time.thread_time() - t0)
    return out[n // 10 :]  # the warm-up dropped


Timed = Callable[[], Awaitable[object]]


async def _timed(n: int, fn: Timed) -> list[float]:
    """CPU seconds of ``n`` calls, the first tenth (warm-up) dropped."""
    out = []
    for _ in range(n):
        t0 = time.thread_time()
        result = await fn()
        out.append(time.thread_time() - t0)
        assert result is not None
    return out[n // 10 :]


async def _measure(
    fetcher: Fetcher, base_url: str, n: int, other_encoding: str | None
) -> dict[str, list[float]]:
    adapter = vllm(base_url)
    health_url, metrics_url = adapter.url(adapter.health_path), adapter.metrics_url
    rows: dict[str, list[float]] = {}
    async with Collector(options=ProviderOptions(connect_attempts=1), fetcher=fetcher) as c:
        c.add("e", adapter, model_id="tiny", poll=False)
        assert (await c.check("e")).ok
        rows["cycle"] = await _timed(n, lambda: c.refresh("e"))
    health = await adapter.check_health(fetcher)
    discovery = await adapter.discover(fetcher, "tiny")
    rows["/metrics scrape"] = await _timed(
        n, lambda: adapter.collect(fetcher, "tiny", discovery, health)
    )
    for url in (metrics_url, health_url):
        assert (await fetcher.get(url, headers={})).status == 200
    rows["GET /metrics"] = await _timed(n, lambda: fetcher.get(metrics_url, headers={}))
    rows["GET /health"] = await _timed(n, lambda: fetcher.get(health_url, headers={}))
    if other_encoding is not None:
        asked = {"Accept-Encoding": other_encoding}
        rows[f"GET /metrics ({other_encoding})"] = await _timed(
            n, lambda: fetcher.get(metrics_url, headers=asked)
        )
    return rows


async def measure_httpx(base_url: str, n: int, live: bool) -> dict[str, list[float]]:
    options = ProviderOptions()
    # As the Collector makes its own client when given none.
    async with httpx.AsyncClient(timeout=options.request_timeout_s, follow_redirects=False) as c:
        return await _measure(HttpxFetcher(c), base_url, n, "identity" if live else None)


async def measure_aiohttp(base_url: str, n: int, live: bool) -> dict[str, list[float]]:
    timeout_s = ProviderOptions().request_timeout_s
    # As capyctl-gateway's collector session (Gateway._collector_ctx).
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=4),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        cookie_jar=aiohttp.DummyCookieJar(),
    ) as session:
        fetcher = AiohttpFetcher(session, timeout_s=timeout_s)
        return await _measure(fetcher, base_url, n, "gzip" if live else None)


GATEWAY_LOOP = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"


def run_like_the_gateway(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on uvloop when it is installed, as capyctl-gateway does."""
    if GATEWAY_LOOP == "asyncio":  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(coro)
    import uvloop

    return uvloop.run(coro)


def measure_all(base_url: str, n: int, rounds: int, *, live: bool = False) -> None:
    """Each fetcher on its event loop; the fetchers take turns, ``rounds`` times, so that a
    change in the machine's load falls on all of them alike. A report line per figure."""
    runs: dict[str, Callable[[int], dict[str, list[float]]]] = {
        "httpx, asyncio": lambda k: anyio.run(measure_httpx, base_url, k, live),
        f"aiohttp, {GATEWAY_LOOP}": lambda k: run_like_the_gateway(
            measure_aiohttp(base_url, k, live)
        ),
        "aiohttp, asyncio": lambda k: asyncio.run(measure_aiohttp(base_url, k, live)),
    }
    pooled: dict[str, dict[str, list[float]]] = {name: {} for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            for what, samples in run(n // rounds).items():
                pooled[name].setdefault(what, []).extend(samples)
    for name, rows in pooled.items():
        report_rows(name, rows)


async def _page(base_url: str) -> tuple[bytes, str]:
    async with httpx.AsyncClient() as client:
        resp = await client.get(base_url + "/metrics")
        return resp.content, resp.headers.get("content-encoding", "none")


def report(name: str, samples: list[float]) -> None:
    ms = sorted(s * 1000 for s in samples)
    print(
        f"{name:42s} CPU median {statistics.median(ms):.3f} ms, "
        f"p90 {ms[int(len(ms) * 0.9)]:.3f} ms, p99 {ms[int(len(ms) * 0.99)]:.3f} ms (n={len(ms)})"
    )


def report_rows(client: str, rows: dict[str, list[float]]) -> None:
    for what, samples in rows.items():
        report(f"{client}: {what}", samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000, help="calls per figure, warm-up included")
    ap.add_argument("--rounds", type=int, default=5, help="turns the fetchers take")
    ap.add_argument("--live-vllm", action="store_true", help="also scrape a real vLLM server")
    args = ap.parse_args()
    n, rounds = args.n, args.rounds
    page = body_of(PAGE)
    lines = page.count(b"\n")
    print(f"page: {PAGE.relative_to(ROOT)} ({len(page)} bytes, {lines} lines)")
    report("parse", bench_parse(page.decode(), n))
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for route, rel in {
            "/metrics": PAGE,
            "/version": ROOT / "contract/recorded/vllm/0.31.0/GET_version.http",
            "/v1/models": ROOT / "contract/recorded/vllm/0.31.0/GET_v1_models.http",
            "/health": ROOT / "contract/recorded/vllm/0.32.0/GET_health.http",
        }.items():
            f = Path(tmp) / route.strip("/").replace("/", "_")
            f.write_bytes(body_of(rel))
            files[route] = f
        routes = [f"{route}={f}" for route, f in files.items()]
        server = subprocess.Popen(
            [sys.executable, "-c", SERVER, "x", *routes], stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline())
            measure_all(f"http://127.0.0.1:{port}", n, rounds)
        finally:
            server.terminate()
            server.wait()
    if args.live_vllm:
        if str(ROOT) not in sys.path:  # run as a script, not with -m: contract/ is not importable
            sys.path.insert(0, str(ROOT))
        from contract.engines.tiny_hf_model import write_tiny_llama
        from contract.engines.vllm import VllmServer, engine_dir, ensure_vllm

        python = ensure_vllm()
        model_dir = engine_dir() / "tiny-llama"
        write_tiny_llama(model_dir, python=python)
        with VllmServer(python, model_dir, max_model_len=16384) as srv:
            page, encoding = anyio.run(_page, srv.base_url)
            newlines = page.count(b"\n")
            print(
                f"live vLLM 0.31.0 /metrics: {len(page)} bytes, {newlines} lines "
                f"(content-encoding to httpx's default request: {encoding})"
            )
            measure_all(srv.base_url, n, rounds, live=True)


if __name__ == "__main__":
    main()
