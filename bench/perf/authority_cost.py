"""What one authority costs per request when several gateway workers ask it (issue 26's design
question): a process that owns every deployment's running bound and FIFO queue, and workers
that ask it once per request over a Unix socket, as a worker process would.

The protocol is the smallest one that keeps the single-process rules: a worker sends
``A <request> <deployment>`` (admit) and waits for ``G <request>`` (granted: a running slot),
then sends ``E <request>`` when the request has ended (no answer). The authority grants in
strict FIFO order per deployment, at most ``--running`` at once. Lines written in one event-loop
iteration leave in one write on both sides, as the gateway's log lines do.

Run from the repository root:
``.venv/bin/python -m bench.perf.authority_cost [--workers 2] [--concurrency 64] [-d 5]``.
It prints one JSON document: requests per second through the authority, and the authority's and
the workers' CPU per request (from ``/proc``), so the authority's ceiling is ``1 / its CPU per
request`` on one core.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from ._procfs import cpu_seconds

__all__ = ["main"]


class Authority(asyncio.Protocol):
    """One worker's connection to the authority; the queues are shared by all connections."""

    running: collections.Counter[bytes] = collections.Counter()
    waiting: dict[bytes, collections.deque[tuple[Authority, bytes]]] = collections.defaultdict(
        collections.deque
    )
    bound = 8
    served = 0

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.held: dict[bytes, bytes] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        lines = (self.buf + data).split(b"\n")
        self.buf = lines.pop()
        out: list[bytes] = []
        for line in lines:
            kind, rid, *rest = line.split(b" ")
            if kind == b"A":
                dep = rest[0]
                self.held[rid] = dep
                if Authority.running[dep] < Authority.bound and not Authority.waiting[dep]:
                    Authority.running[dep] += 1
                    out.append(b"G " + rid + b"\n")
                else:
                    Authority.waiting[dep].append((self, rid))
            else:  # E: a slot comes free; the oldest waiter of that deployment gets it
                dep = self.held.pop(rid)
                Authority.served += 1
                queue = Authority.waiting[dep]
                if queue:
                    who, next_rid = queue.popleft()
                    if who is self:
                        out.append(b"G " + next_rid + b"\n")
                    elif who.transport is not None:
                        who.transport.write(b"G " + next_rid + b"\n")
                else:
                    Authority.running[dep] -= 1
        if out and self.transport is not None:
            self.transport.write(b"".join(out))


def serve(path: str, bound: int, ready: Any) -> None:
    async def run() -> None:
        Authority.bound = bound
        server = await asyncio.get_running_loop().create_unix_server(Authority, path)
        ready.set()
        async with server:
            await server.serve_forever()

    _loop_policy()
    asyncio.run(run())


class Worker(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.waits: dict[bytes, asyncio.Future[None]] = {}
        self.transport: asyncio.Transport | None = None
        self.pending: list[bytes] = []
        self.flush: asyncio.Handle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, line: bytes) -> None:
        self.pending.append(line)
        if self.flush is None:  # one write per loop iteration
            self.flush = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.flush = None
        assert self.transport is not None
        self.transport.write(b"".join(self.pending))
        self.pending.clear()

    def data_received(self, data: bytes) -> None:
        lines = (self.buf + data).split(b"\n")
        self.buf = lines.pop()
        for line in lines:
            fut = self.waits.pop(line[2:], None)
            if fut is not None and not fut.done():
                fut.set_result(None)


def work(path: str, concurrency: int, duration: float, deployments: int, out: Any) -> None:
    async def run() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_unix_connection(Worker, path)
        done = 0
        end = time.monotonic() + duration
        seq = 0

        async def client(i: int) -> None:
            nonlocal done, seq
            dep = b"d%d" % (i % deployments)
            while time.monotonic() < end:
                seq += 1
                rid = b"%d-%d" % (os.getpid(), seq)
                fut = loop.create_future()
                proto.waits[rid] = fut
                proto.send(b"A " + rid + b" " + dep + b"\n")
                await fut
                await asyncio.sleep(0)  # the request's own work would run here
                proto.send(b"E " + rid + b"\n")
                done += 1

        t0 = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        return {"requests": done, "seconds": time.monotonic() - t0}

    _loop_policy()
    out.put(asyncio.run(run()))


def _loop_policy() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a gateway dependency
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.authority_cost")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64, help="requests per worker")
    parser.add_argument("--deployments", type=int, default=4)
    parser.add_argument("--running", type=int, default=8, help="running bound per deployment")
    parser.add_argument("-d", "--duration", type=float, default=5.0)
    args = parser.parse_args(argv)
    ctx = multiprocessing.get_context("spawn")
    path = str(Path(tempfile.mkdtemp(prefix="capyctl-authority-")) / "authority.sock")
    ready, out = ctx.Event(), ctx.Queue()
    authority = ctx.Process(target=serve, args=(path, args.running, ready), daemon=True)
    authority.start()
    ready.wait(10)
    assert authority.pid is not None
    workers = [
        ctx.Process(
            target=work,
            args=(path, args.concurrency, args.duration, args.deployments, out),
            daemon=True,
        )
        for _ in range(args.workers)
    ]
    a0 = cpu_seconds([authority.pid])
    for w in workers:
        w.start()
    results = [out.get(timeout=args.duration + 30) for _ in workers]
    a1 = cpu_seconds([authority.pid])
    w_cpu = sum(cpu_seconds([w.pid]) for w in workers if w.pid is not None)
    for w in workers:
        w.join(10)
    authority.terminate()
    authority.join(10)
    requests = sum(r["requests"] for r in results)
    seconds = max(r["seconds"] for r in results)
    doc = {
        "workers": args.workers,
        "concurrency_per_worker": args.concurrency,
        "deployments": args.deployments,
        "running_bound": args.running,
        "requests": requests,
        "req_per_s": round(requests / seconds),
        "authority_cpu_us_per_request": round((a1 - a0) * 1e6 / requests, 2),
        "workers_cpu_us_per_request": round(w_cpu * 1e6 / requests, 2),
        "authority_ceiling_req_per_s": round(requests / (a1 - a0)) if a1 > a0 else None,
        "nproc": os.cpu_count(),
    }
    sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
