"""How several processes share one public port (issue 26's other design question): each
binding it with ``SO_REUSEPORT`` (the kernel spreads new connections over them), or all
accepting on one socket a parent opened and handed down. A minimal aiohttp application (the
gateway's server stack, uvloop, a small JSON answer) in N processes, loaded by wrk with
keep-alive connections; each process counts what it served.

Run from the repository root (wrk from Debian's package):
``.venv/bin/python -m bench.perf.listen_share [--processes 2] [-c 64] [-d 5]``.
Prints one JSON document per way: req/s, and each process's share of the requests and of the
connections.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import orjson

__all__ = ["main"]

WAYS = ("reuseport", "handoff")
BODY = orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion", "choices": []})


def serve(sock: socket.socket | None, port: int, counts: Any, index: int) -> None:
    import asyncio

    import uvloop
    from aiohttp import web

    served = 0
    conns: set[int] = set()

    async def answer(request: web.Request) -> web.Response:
        nonlocal served
        served += 1
        if request.transport is not None:
            conns.add(id(request.transport))
        counts[2 * index] = served
        counts[2 * index + 1] = len(conns)
        return web.Response(body=BODY, content_type="application/json")

    async def run() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site: web.BaseSite
        if sock is not None:
            site = web.SockSite(runner, sock)
        else:
            site = web.TCPSite(runner, "127.0.0.1", port, reuse_port=True, backlog=4096)
        await site.start()
        await asyncio.Event().wait()

    uvloop.run(run())


def one_way(way: str, processes: int, connections: int, duration: float) -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")
    counts = ctx.Array("q", 2 * processes)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    shared = None
    if way == "handoff":
        shared = socket.socket()
        shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        shared.bind(("127.0.0.1", port))
        shared.listen(4096)
        shared.setblocking(False)
    procs = [
        ctx.Process(target=serve, args=(shared, port, counts, i), daemon=True)
        for i in range(processes)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 10
    while True:  # polled: every process answers once before the load
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("wrk is not installed (scripts/system-packages installs it)")
    for i in range(2 * processes):
        counts[i] = 0
    out = subprocess.run(
        [wrk, "-t1", f"-c{connections}", f"-d{round(duration)}s", f"http://127.0.0.1:{port}/"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for p in procs:
        if p.pid is not None:
            os.kill(p.pid, signal.SIGKILL)
        p.join(5)
    if shared is not None:
        shared.close()
    rps = next(float(line.split()[1]) for line in out.splitlines() if "Requests/sec" in line)
    served = [counts[2 * i] for i in range(processes)]
    conns = [counts[2 * i + 1] for i in range(processes)]
    total = sum(served) or 1
    return {
        "way": way,
        "processes": processes,
        "req_per_s": round(rps),
        "share_of_requests": [round(n / total, 3) for n in served],
        "connections_served": conns,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.listen_share")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("-c", "--connections", type=int, default=64)
    parser.add_argument("-d", "--duration", type=float, default=5.0)
    args = parser.parse_args(argv)
    docs = [one_way("reuseport", 1, args.connections, args.duration)]
    docs += [one_way(w, args.processes, args.connections, args.duration) for w in WAYS]
    for doc in docs:
        sys.stdout.write(orjson.dumps(doc).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
