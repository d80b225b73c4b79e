"""What ``serve --workers N`` costs per request, process by process: the authority's CPU and
the workers' CPU per request on each load, beside one process serving alone in the same run,
and what that says of how far the gateway scales with cores.

Run from the repository root: ``.venv/bin/python -m bench.perf.workers_cost [--workers 2]``.
It starts the fast fake engine, one gateway (one process) and one gateway with N workers, and
loads each in turn with the SSE client: non-streamed requests, 16- and 256-chunk streams, 32
concurrent, for ``--rounds`` rounds. CPU is read from ``/proc`` for each process over each
window. On a machine whose cores the engine and the load client share with the gateway, req/s
does not show scaling; the CPU per request per process does, and it extrapolates: one worker
core serves ``1 / worker CPU per request`` requests a second, and the authority's one core
caps the whole gateway at ``1 / authority CPU per request``.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from types import FrameType

from ._loads import Load, Measure, run_sse
from ._procs import ProcessSet, StartupError, tidy
from .run import start_engine, start_gateway

__all__ = ["main"]

LOADS = (("ns", 8, False), ("s16", 16, True), ("s256", 256, True))


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _per_request_us(m: Measure, pids: list[int]) -> float | None:
    if not m.completed or m.cpu_by_pid is None:
        return None
    return sum(m.cpu_by_pid[str(p)] for p in pids) * 1e6 / m.completed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.workers_cost", description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="capyctl-workers-cost-"))
    procs = ProcessSet(work)
    old = {s: signal.signal(s, _terminate) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    rows: dict[str, dict[str, list[float]]] = {}
    try:
        engine, eport = start_engine(procs)
        url = f"http://127.0.0.1:{eport}"
        _, one = start_gateway(procs, work / "one", url, name="one")
        team_proc, team = start_gateway(
            procs, work / "team", url, args=["--workers", str(args.workers)], name="team"
        )
        workers = list(team.pids[1:])  # the authority first, then its workers
        for r in range(args.rounds):
            for scenario, chunks, stream in LOADS:
                load = Load(scenario, chunks, args.concurrency, stream, args.duration, 1.0)
                got = rows.setdefault(scenario, {})
                m1 = run_sse(one, load, engine.pid)
                m2 = run_sse(team, load, engine.pid)
                for key, value in (
                    ("one_rps", m1.req_per_s),
                    ("team_rps", m2.req_per_s),
                    ("one_us", _per_request_us(m1, [one.pids[0]])),
                    ("authority_us", _per_request_us(m2, [team_proc.pid])),
                    ("workers_us", _per_request_us(m2, workers)),
                ):
                    if value is not None:
                        got.setdefault(key, []).append(value)
                rates = f"{m1.req_per_s:,.0f} / {m2.req_per_s:,.0f} req/s"
                print(f"round {r + 1} {scenario}: {rates}", file=sys.stderr, flush=True)
    except StartupError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    finally:
        procs.stop_all()
        tidy(old, work)
    print(_table(rows, args.workers))
    return 0


def _table(rows: dict[str, dict[str, list[float]]], workers: int) -> str:
    out = [
        f"| load | req/s: one process / {workers} workers | CPU per request: one process | "
        "workers (all) | authority | one worker core serves | the authority's ceiling |",
        "|---|---|---|---|---|---|---|",
    ]
    for scenario, got in rows.items():
        med = {k: statistics.median(v) for k, v in got.items()}
        out.append(
            f"| {scenario} | {med['one_rps']:,.0f} / {med['team_rps']:,.0f} | "
            f"{med['one_us']:.0f} µs | {med['workers_us']:.0f} µs | {med['authority_us']:.0f} µs "
            f"| {1e6 / med['workers_us']:,.0f} req/s | {1e6 / med['authority_us']:,.0f} req/s |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
