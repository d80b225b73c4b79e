"""The soak under its adversaries (issue 34, items 1, 5, 7 and 8): a steady load of small chat
requests through ``serve --workers W`` while, all at once:

1. **slow bodies**: S connections that declare 64 MiB bodies and send a byte a second, opened
   again as the gateway ends them (they must lock no one out: the budget counts what arrived);
5. **a frozen worker**: at a third of the run one worker is stopped (SIGSTOP) and left so (it
   must be replaced within about 5 s, its clients' connections ended, not left waiting);
7. **heavy bodies**: every few seconds, bodies of more small JSON values than
   ``limits.max_json_tokens`` (each must be 413 at once, stalling nobody);
8. **big bodies**: every few seconds, one chat body near ``limits.max_body_bytes`` (each must be
   served: no worker's share of the body budget may refuse it).

A steady request ends served (200 with the engine's answer), refused as documented (a status
with the error's JSON), ended (its connection ended: the frozen worker's, killed), or **lost**
(no answer within the client's timeout). Reported: the steady requests by outcome with their
latency (p50 and p99, over the run and in the frozen worker's window), what each adversary got,
when the frozen worker was replaced, and the gateway's processes' RSS and open files before and
after. It exits 1 when a steady request was lost or refused for the body budget, a heavy body
got anything but 413, a big body anything but 200, or the frozen worker was not replaced.

Run as ``.venv/bin/python -m bench.perf.hostile_soak [--quick] [--json FILE]`` from the
repository root (about 70 s; ``--quick`` about 15 s, which the tests run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from ._loads import Target
from ._procfs import rss_kib
from ._procs import ProcessSet, StartupError, tidy
from .run import _terminate, children, start_engine, start_gateway
from .soak import _pct, fd_count

__all__ = ["main"]

HUGE = 64 * 1024 * 1024
FROZEN_S = 5.0  # the gateway's (capyctl_gateway._workers.messages.FROZEN_S)


async def _steady(t: Target, stop: asyncio.Event, out: list[tuple[float, str, float]]) -> None:
    """One client's requests in a row until ``stop``: (start, outcome, seconds) each."""
    body = {"model": t.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {t.key}"}
    async with httpx.AsyncClient(base_url=t.url, headers=headers, timeout=30) as c:
        while not stop.is_set():
            began = time.monotonic()
            try:
                r = await c.post("/v1/chat/completions", json=body)
                what = "served" if r.status_code == 200 else f"refused {r.status_code} "
                if r.status_code != 200:
                    what += str(r.json().get("code"))
            except httpx.TimeoutException:
                what = "lost"
            except httpx.TransportError:
                what = "ended"
            out.append((began, what, time.monotonic() - began))


async def _slow_body(host: str, port: int, key: str, stop: asyncio.Event) -> int:
    """Connections that declare a 64 MiB body and send a byte a second; how many were opened."""
    opened = 0
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {HUGE}\r\n\r\n"
    ).encode()
    while not stop.is_set():
        opened += 1
        try:
            _, writer = await asyncio.open_connection(host, port)
            writer.write(head)
            while not stop.is_set() and not writer.is_closing():
                writer.write(b" ")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)  # a byte a second
            writer.close()
        except OSError:
            await asyncio.sleep(0.1)  # the gateway ended it: open another
    return opened


def _heavy(tokens: int) -> bytes:
    """A chat body of more small values than ``tokens`` (the gateway's max_json_tokens)."""
    return (
        b'{"model":"bench","messages":[{"role":"user","content":"x"}],"stop":['
        + (b"0," * tokens)
        + b"0]}"
    )


def _big(size: int) -> bytes:
    text = "y" * (size - 200)
    return orjson.dumps(
        {"model": "bench", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    )


async def _periodic(
    t: Target, body: bytes, every: float, at_once: int, stop: asyncio.Event
) -> list[tuple[int | str, float]]:
    """``at_once`` posts of ``body`` every ``every`` s until ``stop``: (status, seconds) each."""
    got: list[tuple[int | str, float]] = []
    headers = {"Authorization": f"Bearer {t.key}", "Content-Type": "application/json"}

    async def one(c: httpx.AsyncClient) -> None:
        began = time.monotonic()
        try:
            r = await c.post("/v1/chat/completions", content=body)
            got.append((r.status_code, time.monotonic() - began))
        except httpx.HTTPError as exc:
            got.append((type(exc).__name__, time.monotonic() - began))

    async with httpx.AsyncClient(base_url=t.url, headers=headers, timeout=60) as c:
        while not stop.is_set():
            await asyncio.gather(*(one(c) for _ in range(at_once)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)
    return got


async def _freeze(pid: int, at: float, stop: asyncio.Event) -> dict[str, Any]:
    """Stop one worker at ``at`` s; when it was replaced (its pid gone, another in its place)."""
    await asyncio.sleep(at)  # the schedule: a third of the run
    workers = children(pid)
    victim = workers[0]
    os.kill(victim, signal.SIGSTOP)
    frozen_at = time.monotonic()
    replaced = None
    while not stop.is_set():
        now = children(pid)
        if victim not in now and len(now) == len(workers):
            replaced = time.monotonic() - frozen_at
            break
        await asyncio.sleep(0.1)  # polling processes, which announce nothing
    with contextlib.suppress(ProcessLookupError):
        os.kill(victim, signal.SIGCONT)
    return {"frozen_at": frozen_at, "replaced_after_s": replaced, "pid": victim}


def _resources(pid: int) -> dict[str, Any]:
    pids = [pid, *children(pid)]
    rss = [r for r in map(rss_kib, pids) if r is not None]
    fds = [f for f in map(fd_count, pids) if f is not None]
    return {"rss_mib": round(sum(rss) / 1024, 1), "fds": sum(fds), "processes": len(pids)}


async def _run(args: argparse.Namespace, t: Target, gateway_pid: int) -> dict[str, Any]:
    host, port = urlsplit(t.url).hostname or "127.0.0.1", urlsplit(t.url).port or 80
    stop = asyncio.Event()
    steady: list[tuple[float, str, float]] = []
    before = _resources(gateway_pid)
    began = time.monotonic()
    tasks = [asyncio.ensure_future(_steady(t, stop, steady)) for _ in range(args.clients)]
    slow = [
        asyncio.ensure_future(_slow_body(host, port, t.key or "", stop)) for _ in range(args.slow)
    ]
    heavy = asyncio.ensure_future(_periodic(t, _heavy(args.tokens), args.every, 4, stop))
    big = asyncio.ensure_future(_periodic(t, _big(args.big_mib * 2**20), args.every * 2, 1, stop))
    frozen = asyncio.ensure_future(_freeze(gateway_pid, args.duration / 3, stop))
    await asyncio.sleep(args.duration)  # the run's length
    stop.set()
    await asyncio.gather(*tasks)
    opened = sum(await asyncio.gather(*slow))
    heavy_got, big_got, freeze = await heavy, await big, await frozen
    window = (freeze["frozen_at"], freeze["frozen_at"] + FROZEN_S + 2)
    during = [s for b, w, s in steady if window[0] <= b <= window[1] and w == "served"]
    outcomes = Counter(w for _, w, _ in steady)
    served = [s for _, w, s in steady if w == "served"]
    return {
        "duration_s": round(time.monotonic() - began, 1),
        "steady": {
            "requests": len(steady),
            "outcomes": dict(outcomes),
            "p50_ms": _ms(_pct(served, 0.5)),
            "p99_ms": _ms(_pct(served, 0.99)),
            "p99_ms_while_frozen": _ms(_pct(during, 0.99)),
        },
        "slow_bodies_opened": opened,
        "heavy": dict(Counter(str(s) for s, _ in heavy_got)),
        "heavy_p99_ms": _ms(_pct([s for _, s in heavy_got], 0.99)),
        "big": dict(Counter(str(s) for s, _ in big_got)),
        "frozen_worker_replaced_after_s": freeze["replaced_after_s"],
        "before": before,
        "after": _resources(gateway_pid),
    }


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 1)


_ENDED = {"ReadError", "RemoteProtocolError", "WriteError", "ConnectError"}
"""What a request whose connection the frozen worker held hears when it is killed."""


def problems(doc: dict[str, Any]) -> list[str]:
    """What breaks the rules the module's text lists (a connection the frozen worker held,
    ended when it was killed, is none: its client hears of it, nothing waits)."""
    bad = []
    steady = doc["steady"]["outcomes"]
    if steady.get("lost"):
        bad.append(f"{steady['lost']} steady requests lost")
    budget = [w for w in steady if w.startswith("refused 503")]
    if budget:
        bad.append(f"steady requests refused 503: {budget}")
    if set(doc["heavy"]) - {"413", *_ENDED}:
        bad.append(f"heavy bodies answered {doc['heavy']}")
    if set(doc["big"]) - {"200", *_ENDED}:
        bad.append(f"big bodies answered {doc['big']}")
    if doc["frozen_worker_replaced_after_s"] is None:
        bad.append("the frozen worker was not replaced")
    return bad


def markdown(doc: dict[str, Any]) -> str:
    s = doc["steady"]
    return "\n".join(
        [
            f"### The soak under its adversaries ({doc['duration_s']} s, "
            f"{doc['meta']['workers']} workers)",
            "",
            "| what | result |",
            "|---|---|",
            f"| steady requests | {s['requests']}: {s['outcomes']} |",
            f"| their latency, p50 / p99 | {s['p50_ms']} / {s['p99_ms']} ms |",
            f"| p99 while a worker was frozen | {s['p99_ms_while_frozen']} ms |",
            f"| slow bodies (64 MiB declared, a byte a second) | {doc['slow_bodies_opened']} |",
            f"| heavy bodies (past max_json_tokens) | {doc['heavy']}, p99 "
            f"{doc['heavy_p99_ms']} ms |",
            f"| big bodies ({doc['meta']['big_mib']} MiB) | {doc['big']} |",
            f"| frozen worker replaced after | {doc['frozen_worker_replaced_after_s']} s |",
            f"| gateway processes before / after | {doc['before']} / {doc['after']} |",
            "",
            "problems: " + ("; ".join(doc["problems"]) or "none"),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.hostile_soak", description=__doc__)
    p.add_argument("--quick", action="store_true", help="15 s, 2 workers, smaller bodies")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--workers", type=int, default=5, help="5: item 8's case (shares of 51 MiB)")
    p.add_argument("--clients", type=int, default=16, help="steady clients")
    p.add_argument("--slow", type=int, default=64, help="slow-body connections")
    p.add_argument("--every", type=float, default=5.0, help="seconds between heavy bodies")
    p.add_argument("--tokens", type=int, default=1_100_000, help="values in a heavy body")
    p.add_argument("--big-mib", type=int, default=60, help="a big body's size")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the logs")
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.workers, args.clients, args.slow = 16.0, 2, 6, 16
        args.every, args.big_mib = 3.0, 16

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    work = Path(tempfile.mkdtemp(prefix="capyctl-hostile-"))
    old = {s: signal.signal(s, _terminate) for s in (signal.SIGINT, signal.SIGTERM)}
    procs = ProcessSet(work)
    try:
        engine, eport = start_engine(procs)
        gateway, target = start_gateway(
            procs, work / "gw", f"http://127.0.0.1:{eport}", args=["--workers", str(args.workers)]
        )
        doc = asyncio.run(_run(args, target, gateway.pid))
    except StartupError as exc:
        log(f"hostile soak: {exc}")
        return 2
    finally:
        procs.stop_all()
        tidy(old, work, keep=args.keep, log=log)
    doc["meta"] = {"workers": args.workers, "big_mib": args.big_mib, "quick": args.quick}
    doc["problems"] = problems(doc)
    print(markdown(doc), flush=True)
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return 1 if doc["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
