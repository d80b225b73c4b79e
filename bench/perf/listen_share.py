"""How several processes share one public port (issue 26's other design question): each
binding it with ``SO_REUSEPORT`` (the kernel spreads new connections over them), or all
accepting on one socket a parent opened and handed down, or one process accepting every
connection and passing each to a worker in turn (``SCM_RIGHTS``). A minimal aiohttp application (the
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

WAYS = ("reuseport", "handoff", "passing")
BODY = orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion", "choices": []})


def serve(
    sock: socket.socket | None,
    port: int,
    counts: Any,
    index: int,
    line: socket.socket | None,
    ready: Any,
) -> None:
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
        if line is not None:  # "passing": connections come as descriptors over ``line``
            loop = asyncio.get_running_loop()
            line.setblocking(False)
            handler = runner.server
            assert handler is not None

            def take() -> None:
                try:
                    _, fds, _, _ = socket.recv_fds(line, 64, 64)
                except BlockingIOError:
                    return
                for fd in fds:
                    conn = socket.socket(fileno=fd)
                    conn.setblocking(False)
                    loop.create_task(loop.connect_accepted_socket(handler, conn))

            loop.add_reader(line.fileno(), take)
            ready[index] = 1
            await asyncio.Event().wait()
        if sock is not None:
            site = web.SockSite(runner, sock)
        else:
            site = web.TCPSite(runner, "127.0.0.1", port, reuse_port=True, backlog=4096)
        await site.start()
        ready[index] = 1
        await asyncio.Event().wait()

    uvloop.run(run())


def accept_and_pass(listening: socket.socket, lines: list[socket.socket]) -> None:
    """Accept every connection and pass it to the workers in turn (``SCM_RIGHTS``)."""
    turn = 0
    while True:
        conn, _ = listening.accept()
        socket.send_fds(lines[turn % len(lines)], [b"c"], [conn.fileno()])
        conn.close()
        turn += 1


def one_way(way: str, processes: int, connections: int, duration: float) -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")
    counts = ctx.Array("q", 2 * processes)
    ready = ctx.Array("q", processes)
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
    lines: list[tuple[socket.socket, socket.socket]] = []
    if way == "passing":  # one process accepts and hands each connection to the next worker
        lines = [socket.socketpair() for _ in range(processes)]
        listening = socket.socket()
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(("127.0.0.1", port))
        listening.listen(4096)
        acceptor = ctx.Process(
            target=accept_and_pass, args=(listening, [a for a, _ in lines]), daemon=True
        )
    procs = [
        ctx.Process(
            target=serve,
            args=(shared, port, counts, i, lines[i][1] if lines else None, ready),
            daemon=True,
        )
        for i in range(processes)
    ]
    if lines:
        procs.append(acceptor)
    for p in procs:
        p.start()
    if lines:
        listening.close()  # the acceptor has its own
    deadline = time.monotonic() + 10
    while not all(ready[:]):  # polled: every process listens before the load (else the first
        if time.monotonic() > deadline:  # to listen takes every connection, whatever the way)
            raise SystemExit(f"{way}: not every process listened within 10 s")
        time.sleep(0.05)
    while True:  # and the port answers
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
    served = [counts[2 * i] for i in range(processes)]  # the workers (not the acceptor)
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
