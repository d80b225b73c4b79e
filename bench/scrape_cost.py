"""CPU cost of collecting one real vLLM /metrics page.

Two figures, on the page captured live from vLLM 0.31.0 (47 KB, 582 lines):
  * parse: the adapter turning the exposition into a snapshot's metrics (pure CPU);
  * scrape: one whole collection cycle through the Collector (health + metrics over HTTP
    with httpx, parse, snapshot), counting only the CPU of the thread that runs it. The
    engine is a separate process (python -m http.server style), so its CPU is not counted.

Run: .venv/bin/python bench/scrape_cost.py [--n 2000]
     .venv/bin/python -m bench.scrape_cost --live-vllm   # also against a real vLLM 0.31.0 server
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import anyio

from canopyx_provider import Collector, ProviderOptions, vllm

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "contract/recorded/vllm/0.31.0/GET_metrics_idle.http"

SERVER = r"""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
files = dict(a.split("=", 1) for a in sys.argv[2:])
bodies = {path: open(f, "rb").read() for path, f in files.items()}
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
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
    return out


async def bench_scrape(port: int, n: int, *, base_url: str | None = None) -> list[float]:
    out = []
    async with Collector(options=ProviderOptions(connect_attempts=1)) as c:
        c.add("e", vllm(base_url or f"http://127.0.0.1:{port}"), model_id="tiny", poll=False)
        assert (await c.check("e")).ok
        for _ in range(n):
            t0 = time.thread_time()
            snap = await c.refresh("e")
            out.append(time.thread_time() - t0)
            assert snap is not None
    return out


async def _page(base_url: str) -> bytes:
    import httpx

    async with httpx.AsyncClient() as client:
        return (await client.get(base_url + "/metrics")).content


def report(name: str, samples: list[float]) -> None:
    ms = sorted(s * 1000 for s in samples[len(samples) // 10 :])  # drop warm-up
    print(
        f"{name:7s} CPU per scrape: median {statistics.median(ms):.3f} ms, "
        f"p90 {ms[int(len(ms) * 0.9)]:.3f} ms, p99 {ms[int(len(ms) * 0.99)]:.3f} ms (n={len(ms)})"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--live-vllm", action="store_true", help="also scrape a real vLLM server")
    args = ap.parse_args()
    n = args.n
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
            report("scrape", anyio.run(bench_scrape, port, n))
        finally:
            server.terminate()
            server.wait()
    if args.live_vllm:
        from contract.engines.tiny_hf_model import write_tiny_llama
        from contract.engines.vllm import VllmServer, engine_dir, ensure_vllm

        python = ensure_vllm()
        model_dir = engine_dir() / "tiny-llama"
        write_tiny_llama(model_dir, python=python)
        with VllmServer(python, model_dir, max_model_len=16384) as srv:
            page = anyio.run(_page, srv.base_url)
            newlines = page.count(b"\n")
            print(f"live vLLM 0.31.0 /metrics: {len(page)} bytes, {newlines} lines")
            report("live", anyio.run(partial(bench_scrape, 0, n, base_url=srv.base_url)))


if __name__ == "__main__":
    main()
