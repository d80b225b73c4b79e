"""CPU per chunk when chunks come as engines send them: one per read.

``bench.perf.run``'s fake engine writes a whole answer at once, so the gateway reads many chunks
per read and its per-chunk figure is the cost of the work on a chunk alone. An engine that is
generating writes each token's chunk when it has it: every chunk is then its own read, its own
wake-up of the relay and its own write to the client. This measures that: the fake engine paces
its chunks (``--delay-ms`` apart), streams of 16 and 128 content chunks run at ``--concurrency``,
and the CPU per extra chunk is (CPU per 128-chunk stream - CPU per 16-chunk stream) / 112,
paired within each round, for the engine alone (direct), the gateway and vllm-router, and with
``--floor`` for `floor_relay`, which writes each read to the client as it came.

Run from the repository root: ``.venv/bin/python -m bench.perf.paced [--rounds 3]`` (about
1.5 min a round with vllm-router).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from ._loads import Load, run_sse
from ._procs import ProcessSet
from .ab import _floor
from .run import _serve

__all__ = ["main"]

SHORT, LONG = 16, 128


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.paced", description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=4.0, help="seconds per window")
    p.add_argument("--delay-ms", type=float, default=2.0, help="between an answer's chunks")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--no-peer", action="store_true", help="skip vllm-router")
    p.add_argument("--peer-bin", default=None)
    p.add_argument("--floor", action="store_true", help="and floor_relay, streaming each read")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="capyctl-paced-"))
    procs = ProcessSet(work)
    per_chunk: dict[str, list[float]] = {}
    rps: dict[tuple[str, int], list[float]] = {}
    try:
        targets, engine_pid = _serve(args, procs, work)
        if args.floor:
            targets.append(_floor(procs, targets[0].url, targets[1].model))
        for i in range(args.rounds):
            for t in targets:
                cpu = {}
                for chunks in (SHORT, LONG):
                    load = Load(f"p{chunks}", chunks, args.concurrency, True, args.duration, 0.5,
                                delay_ms=args.delay_ms)  # fmt: skip
                    m = run_sse(t, load, engine_pid)
                    spent = m.engine_cpu_s if t.name == "direct" else m.cpu_s
                    cpu[chunks] = 1000 * (spent or 0.0) / max(1, m.completed)
                    rps.setdefault((t.name, chunks), []).append(m.req_per_s)
                us = (cpu[LONG] - cpu[SHORT]) / (LONG - SHORT) * 1000
                per_chunk.setdefault(t.name, []).append(us)
                print(f"round {i + 1} {t.name:>7}: {us:5.1f} us per extra chunk", file=sys.stderr)
    finally:
        procs.stop_all()
    print(
        f"Paced chunks ({args.delay_ms:g} ms apart), {args.concurrency} streams at once, "
        f"{args.rounds} rounds of {args.duration:g} s; medians.\n"
    )
    print("| target | CPU per extra chunk | 16-chunk streams | 128-chunk streams |")
    print("|---|---|---|---|")
    shown = {"direct": "the engine alone (direct)", "gateway": "capyctl-gateway",
             "peer": "vllm-router", "floor": "floor_relay"}  # fmt: skip
    for name, values in per_chunk.items():
        print(
            f"| {shown.get(name, name)} | {statistics.median(values):.1f} µs | "
            f"{statistics.median(rps[(name, SHORT)]):,.0f} req/s | "
            f"{statistics.median(rps[(name, LONG)]):,.0f} req/s |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
