"""The clients of the soak across machines (``bench.perf.machines_soak``), run inside the
server's network namespace, where the server's listeners and the hosts' ingresses are reachable:

* ``load``: chat requests for ``--duration`` seconds over ``--concurrency`` connections, each
  with a plan of the fault soak (``bench.perf.faults``): streamed or not, a hang-up while the body
  is sent, a few ms after sending (queued), on the role chunk of a slow stream, mid-stream, or
  (not streamed, a slow engine) while the engine works; or none. Every request is classified as
  the fault soak does (served, a documented HTTP or in-band error, hung up, lost).
* ``flood``: idle connections to each listener named by ``--target NAME=HOST:PORT:MODE``, at most
  ``--count`` to each, opened at once and held up to ``--hold`` seconds: ``idle`` ones send
  nothing; ``keepalive`` ones send one ``GET`` and, answered, stay idle. For each it notes whether
  and when the listener closed it, and what it answered.

Each writes its figures as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import resource
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .faults import Ctx, Plan, make_plans, run_one
from .soak import _run_async

__all__ = ["LOAD_KINDS", "main"]

LOAD_KINDS = [
    "none/normal",
    "none/slow",
    "body/normal",
    "queued/normal",
    "first_token/slow",
    "mid_stream/normal",
]
"""The fault soak's plan kinds used here: no engine faults (the faults are the machines'), and
none that needs to ask the engine whether it has a request (it is on another machine)."""


def plans(n: int, seed: int) -> list[Plan]:
    """``n`` plans; half of the non-streamed ``queued`` ones become hang-ups while a slow engine
    works on the request (``queued/slow/json``: 100 to 800 ms after sending, the engine's first
    token 1.5 s away)."""
    out = make_plans(n, seed, only=LOAD_KINDS)
    rng = random.Random(seed + 1)
    for p in out:
        if p.phase == "queued" and not p.stream and rng.random() < 0.5:
            p.mode, p.ttft_ms, p.chunks = "slow", 1500, 4
            p.hangup_ms = rng.randint(100, 800)
    return out


async def load(args: argparse.Namespace, key: str) -> dict[str, Any]:
    ctx = Ctx(args.host, args.port, key, engine_port=0, timeout_s=args.client_timeout_s)
    todo = iter(plans(args.max_requests, args.seed))
    started = time.monotonic()
    end = started + args.duration
    rows: list[dict[str, Any]] = []

    async def worker() -> None:
        while time.monotonic() < end:
            plan = next(todo)
            at = time.monotonic() - started
            r = await run_one(ctx, plan)
            rows.append({**asdict(r), "at": round(at, 3), "stream": plan.stream})

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return {"seed": args.seed, "took_s": round(time.monotonic() - started, 2), "results": rows}


async def _one_flood_connection(
    host: str, port: int, mode: str, hold_s: float, row: dict[str, Any]
) -> None:
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    except (OSError, TimeoutError) as exc:
        row["outcome"] = f"connect failed: {type(exc).__name__}"
        return
    try:
        async with asyncio.timeout(hold_s):
            if mode == "keepalive":
                writer.write(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n") if mode == "keepalive" else b""
            if head:
                row["status"] = int(head.split(b" ", 2)[1])
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        await reader.readexactly(int(value))
            rest = await reader.read(65536)  # the next bytes, or b"" once the listener closed
            if rest.startswith(b"HTTP/1.1 "):  # an answer unasked: the busy 503
                row["status"] = int(rest.split(b" ", 2)[1])
                while await reader.read(65536):
                    pass
            row["outcome"] = "closed by the listener"
            row["closed_after_s"] = round(time.monotonic() - t0, 3)
    except TimeoutError:
        row["outcome"] = "still open"
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        row["outcome"] = "closed by the listener"
        row["closed_after_s"] = round(time.monotonic() - t0, 3)
        row["error"] = type(exc).__name__
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def flood(args: argparse.Namespace) -> dict[str, Any]:
    need = 64 + sum(args.count for _ in args.target)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    rows: dict[str, list[dict[str, Any]]] = {}
    tasks = []
    for target in args.target:
        name, _, addr = target.partition("=")
        host, port, mode = addr.split(":")
        rows[name] = [{} for _ in range(args.count)]
        tasks += [
            _one_flood_connection(host, int(port), mode, args.hold, row) for row in rows[name]
        ]
    await asyncio.gather(*tasks)
    out: dict[str, Any] = {}
    for name, rs in rows.items():
        closed = sorted(r["closed_after_s"] for r in rs if "closed_after_s" in r)
        out[name] = {
            "opened": sum(1 for r in rs if not r.get("outcome", "").startswith("connect failed")),
            "outcomes": dict(Counter(r.get("outcome", "?") for r in rs)),
            "statuses": dict(Counter(str(r["status"]) for r in rs if "status" in r)),
            "closed_within_1s": sum(1 for c in closed if c < 1),
            "closed_after_s_min": closed[0] if closed else None,
            "closed_after_s_median": closed[len(closed) // 2] if closed else None,
            "closed_after_s_max": closed[-1] if closed else None,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.perf.machines_load")
    sub = p.add_subparsers(dest="what", required=True)
    lp = sub.add_parser("load")
    lp.add_argument("--host", required=True)
    lp.add_argument("--port", type=int, default=8443)
    lp.add_argument("--key-file", required=True)
    lp.add_argument("--duration", type=float, required=True)
    lp.add_argument("--concurrency", type=int, default=16)
    lp.add_argument("--seed", type=int, required=True)
    lp.add_argument("--max-requests", type=int, default=200_000)
    lp.add_argument("--client-timeout-s", type=float, default=30.0)
    lp.add_argument("--out", required=True)
    fp = sub.add_parser("flood")
    fp.add_argument("--target", action="append", required=True, help="NAME=HOST:PORT:MODE")
    fp.add_argument("--count", type=int, default=150)
    fp.add_argument("--hold", type=float, default=20.0)
    fp.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.what == "load":
        key = json.loads(Path(args.key_file).read_text())["api_key"]
        doc = _run_async(load(args, key))
    else:
        doc = _run_async(flood(args))
    Path(args.out).write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
