"""What aiohttp alone costs per request, on each side of a relay: the floor under the gateway.

Two figures, each the CPU of the process that does the work, per request, at 32 concurrent:

* **client**: an ``aiohttp.ClientSession`` set up as the gateway's (no cookie jar, no
  decompression, its own headers) posting to the fake engine and reading the answer to its end
  without looking at it: one JSON document, and streams of 11 and 19 chunks (what the gateway
  reads for an 8-token non-streamed answer and for a 16-chunk stream);
* **server**: an ``aiohttp.web`` application that reads the request body and answers a small JSON
  document, or a two-event stream (``StreamResponse``: prepare, one write, ``write_eof``), loaded
  by the SSE client.

Nothing of the gateway runs: these are what any aiohttp relay pays before verifying, accounting or
logging anything. Run: ``.venv/bin/python -m bench.perf.aiohttp_floor [--duration 4]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson

from ._loads import Load, Target, run_sse
from ._procs import ProcessSet, free_port
from .run import start_engine

__all__ = ["main"]

T = TypeVar("T")

SERVER = r"""
import asyncio, sys
from aiohttp import web
try:
    import uvloop
except ImportError:
    uvloop = None
BODY = b'{"id":"x","object":"chat.completion","choices":[]}'
EVENTS = b'data: {"x":1}\n\n'

async def health(request):
    return web.Response()

async def answer(request):
    if b'"stream":true' in await request.read():
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(EVENTS)
        await out.write_eof(b"data: [DONE]\n\n")
        return out
    return web.Response(body=BODY, content_type="application/json")

async def main():
    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", int(sys.argv[1]), backlog=4096).start()
    await asyncio.Event().wait()

(uvloop.run if uvloop else asyncio.run)(main())
"""


async def _client(port: int, *, stream: bool, tokens: int, duration: float) -> tuple[int, float]:
    body = orjson.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": tokens,
            "stream": stream,
            "stream_options": {"include_usage": True},
        }
    )
    headers = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream" if stream else "application/json",
        "Accept-Encoding": "identity",
        "User-Agent": "aiohttp-floor",
    }
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    done = 0
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
    ) as session:

        async def worker(until: float, count: bool) -> None:
            nonlocal done
            while time.monotonic() < until:
                resp = await session.post(url, data=body, headers=headers)
                while await resp.content.readany():
                    pass
                resp.release()
                if count:
                    done += 1

        await asyncio.gather(*[worker(time.monotonic() + 0.5, False) for _ in range(32)])
        start = time.process_time()
        await asyncio.gather(*[worker(time.monotonic() + duration, True) for _ in range(32)])
        return done, time.process_time() - start


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """On uvloop, as the gateway runs, where it is installed."""
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency everywhere but Windows
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.aiohttp_floor", description=__doc__)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per figure")
    args = parser.parse_args(argv)
    print("| side | what | CPU µs per request |\n|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        procs = ProcessSet(Path(work))
        try:
            _, eport = start_engine(procs)
            for stream, tokens, what in (
                (False, 8, "one JSON answer"),
                (True, 8, "an 11-chunk stream"),
                (True, 16, "a 19-chunk stream"),
            ):
                n, cpu = _run(_client(eport, stream=stream, tokens=tokens, duration=args.duration))
                print(f"| client | {what} ({n:,} requests) | {cpu / n * 1e6:.1f} |", flush=True)
            sport = free_port()
            server = procs.start("server", [sys.executable, "-c", SERVER, str(sport)])
            server.wait_http(f"http://127.0.0.1:{sport}/health")
            target = Target("aiohttp", f"http://127.0.0.1:{sport}", "tiny", None, (server.pid,))
            for stream, what in ((False, "a small JSON answer"), (True, "a two-event stream")):
                load = Load("floor", 1, 32, stream, args.duration, 0.5)
                m = run_sse(target, load, server.pid)
                per = m.cpu_ms_per_req
                if m.failed or per is None:
                    raise RuntimeError(f"the load failed: {m.first_error}")
                print(f"| server | {what} ({m.completed:,} requests) | {per * 1000:.1f} |")
        finally:
            procs.stop_all()


if __name__ == "__main__":
    main()
