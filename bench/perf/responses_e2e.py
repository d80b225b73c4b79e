"""The Responses API end to end, beside chat: the same gateway, the same fake engine and the same
question, asked of ``POST /v1/chat/completions`` and of ``POST /v1/responses`` in turn, with the
gateway's CPU per request read from ``/proc`` around each window (the SSE client, 32 concurrent).

`bench.perf.responses_cost` times the translation alone, per chunk; this is what a request costs
through everything: aiohttp, the checks, the engine exchange and the events written. The two APIs
take turns within each round (which goes first alternates), so a drift of the machine falls on
both; the ratio is the median over rounds of each round's pair.

Run from the repository root: ``.venv/bin/python -m bench.perf.responses_e2e [--rounds 5]
[--duration 5] [--json FILE]``. It prints a markdown table and stops everything it started.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from ._loads import Load, Measure, Target, run_sse
from ._procs import ProcessSet, StartupError
from ._report import write_json
from .run import _machine, _terminate, start_engine, start_gateway

__all__ = ["compare", "main", "markdown", "summarize"]

APIS = ("chat", "responses")


def _loads(args: argparse.Namespace, api: str) -> list[Load]:
    d, w, c = args.duration, args.warmup, args.concurrency
    return [
        Load("ns", args.ns_tokens, c, stream=False, duration_s=d, warmup_s=w, api=api),
        Load("s16", 16, c, stream=True, duration_s=d, warmup_s=w, api=api),
        Load("s256", 256, c, stream=True, duration_s=d, warmup_s=w, api=api),
    ]


def _check(t: Target) -> None:
    """One question each way, answered whole: the load measures answers, not refusals."""
    headers = {"Authorization": f"Bearer {t.key}"}
    chat = httpx.post(
        f"{t.url}/v1/chat/completions",
        json={"model": t.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers=headers,
        timeout=10,
    )
    resp = httpx.post(
        f"{t.url}/v1/responses",
        json={"model": t.model, "input": "hi", "max_output_tokens": 4},
        headers=headers,
        timeout=10,
    )
    if chat.status_code != 200 or resp.status_code != 200:
        raise StartupError(f"chat {chat.status_code}, responses {resp.status_code}: {resp.text}")
    doc = resp.json()  # the fake engine stops at max_tokens: incomplete, as chat's "length"
    if doc["status"] not in ("completed", "incomplete") or not doc["output"]:
        raise StartupError(f"the Response is not whole: {resp.text}")


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def summarize(
    rounds: list[dict[str, dict[str, Measure]]], apis: tuple[str, str] = APIS
) -> list[dict[str, Any]]:
    """Per scenario: each API's median CPU ms per request and req/s (``apis``: chat and the
    other), and the ratio's median over the rounds' pairs; a figure not measured (no request
    completed) is left out."""
    rows = []
    for scenario in rounds[0]:
        cpu: dict[str, list[float]] = {api: [] for api in apis}
        rate: dict[str, list[float]] = {api: [] for api in apis}
        ratios, failed = [], 0
        for r in rounds:
            pair = r[scenario]
            for api in apis:
                m = pair[api]
                failed += m.failed
                if m.cpu_ms_per_req is not None:
                    cpu[api].append(m.cpu_ms_per_req)
                    rate[api].append(m.req_per_s)
            a, b = pair[apis[0]].cpu_ms_per_req, pair[apis[1]].cpu_ms_per_req
            if a and b is not None:
                ratios.append(b / a)
        row: dict[str, Any] = {"scenario": scenario, "failed": failed}
        for api in apis:
            row[f"{api}_cpu_ms_per_req"] = _median(cpu[api])
            row[f"{api}_req_per_s"] = _median(rate[api])
        row["ratio"] = _median(ratios)
        row["ratio_range"] = [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], apis: tuple[str, str] = APIS) -> str:
    """The table: each API's CPU a request, their ratio (the median of the rounds' and its
    range: the rounds' spread), and what the other API adds a request."""
    other = apis[1]

    def ms(v: float | None) -> str:
        return "not measured" if v is None else f"{v:.3f}"

    lines = [
        f"| load (32 concurrent) | chat: CPU ms/request | {other}: CPU ms/request | ratio "
        f"| the rounds' ratios | added a request | chat req/s | {other} req/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    added: dict[str, float] = {}
    for row in rows:
        a, b = row["chat_cpu_ms_per_req"], row[f"{other}_cpu_ms_per_req"]
        if a is not None and b is not None:
            added[row["scenario"]] = (b - a) * 1000
        more = f"{added[row['scenario']]:.0f} µs" if row["scenario"] in added else "not measured"
        ratio = "not measured" if row["ratio"] is None else f"{row['ratio']:.2f}"
        spread = row["ratio_range"]
        spread_s = "not measured" if spread is None else f"{spread[0]:.2f}–{spread[1]:.2f}"
        lines.append(
            f"| {row['scenario']} | {ms(a)} | {ms(b)} | {ratio} | {spread_s} | {more} "
            f"| {row['chat_req_per_s'] or 0:,.0f} | {row[f'{other}_req_per_s'] or 0:,.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return compare(argv, APIS, _check, prog="python -m bench.perf.responses_e2e", doc=__doc__)


def compare(
    argv: list[str] | None,
    apis: tuple[str, str],
    check: Callable[[Target], None],
    *,
    prog: str,
    doc: str | None,
) -> int:
    """Chat and another API (``apis``), in turn, as this module's text says; ``check``: one
    question each way before the load."""
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per window")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before each window")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--ns-tokens", type=int, default=8, help="tokens of a non-streamed answer")
    parser.add_argument("--json", type=Path, default=None, help="write every measurement here")
    args = parser.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    work = Path(tempfile.mkdtemp(prefix=f"capyctl-bench-{apis[1]}-"))
    procs = ProcessSet(work)
    old = {s: signal.signal(s, _terminate) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    started = time.monotonic()
    rounds: list[dict[str, dict[str, Measure]]] = []
    try:
        engine, eport = start_engine(procs)
        _, target = start_gateway(procs, work, f"http://127.0.0.1:{eport}")
        check(target)
        loads = {api: _loads(args, api) for api in apis}
        for i in range(args.rounds):
            order = apis if i % 2 == 0 else apis[::-1]
            r: dict[str, dict[str, Measure]] = {}
            for k in range(len(loads["chat"])):
                for api in order:
                    load = loads[api][k]
                    m = run_sse(target, load, engine.pid)
                    r.setdefault(load.scenario, {})[api] = m
                    cpu = m.cpu_ms_per_req
                    log(
                        f"round {i + 1} {load.scenario:>4} {api:>9}: {m.req_per_s:>7,.0f} req/s"
                        + (f"  cpu {cpu:.3f} ms/req" if cpu is not None else "")
                        + (f"  FAILED {m.failed} ({m.first_error})" if m.failed else "")
                    )
            rounds.append(r)
        meta: dict[str, Any] = {
            "rounds": args.rounds,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "concurrency": args.concurrency,
            "ns_tokens": args.ns_tokens,
            "processes": {p.name: p.pid for p in procs.procs},
            "machine": _machine(),
        }
    except StartupError as exc:
        log(f"bench: {exc}")
        return 2
    finally:
        procs.stop_all()
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(work, ignore_errors=True)
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    rows = summarize(rounds, apis)
    print(markdown(rows, apis), flush=True)
    if args.json is not None:
        write_json(args.json, meta, rows, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
