"""Two gateway source trees side by side: the same fake engine, loads alternated in pairs.

On a machine whose speed drifts (a shared VM does, by 20-40% over minutes), two separate runs of
``bench.perf.run`` cannot tell a 10% change from the drift. This runs a gateway from each tree at
once in front of one engine and alternates short windows between them, swapping the order every
round; the figure is the median over rounds of each pair's ratio.

Run from the repository root, with a worktree of the commit to compare against::

    git worktree add /tmp/base <commit>
    .venv/bin/python -m bench.perf.ab --base /tmp/base/src --new src --rounds 6

Each tree is put first on the gateway process's ``PYTHONPATH``; it prints one line per round and
the ratios (new / base, CPU milliseconds per request).

``--together`` loads both gateways at the same time instead (each with half the concurrency, its
own load generator), so that whatever the machine does during a window it does to both: on a VM
whose speed swings within seconds, the pairs' spread narrows from about +-20% to about +-8%.

``--floor`` adds `floor_relay` to the non-streamed load (in turn with the gateways): what a
gateway costs above it is its own work, and the report gives each tree's.

``--instances 2`` serves the engine as two instances of the deployment, so that each request
goes through the choice among instances (and, with prefix routing, its fingerprints).

``--paced`` has the engine send its chunks 2 ms apart, each a read of its own, as a generating
engine does (see `bench.perf.paced`), instead of the usual loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ._loads import Load, Target, run_sse, run_wrk, wrk_path
from ._procs import Proc, ProcessSet, free_port
from .run import _terminate, start_engine, start_gateway

__all__ = ["main"]


def gateway_from_tree(
    procs: ProcessSet,
    work: Path,
    engine_url: str,
    src: str,
    *,
    engine: str = "vllm",
    engine_version: str = "0.31.0",
    instances: int = 1,
) -> Target:
    """A gateway whose code comes from the source tree ``src``, serving the engine at
    ``engine_url`` (of kind ``engine``, ``engine_version``) as ``instances`` instances."""
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
    start = procs.start

    def with_env(name: str, argv: list[str], **_: object) -> Proc:
        return start(f"{name}-{work.name}", argv, env=env)

    procs.start = with_env  # type: ignore[method-assign,assignment]
    try:
        work.mkdir()
        extra = f"      - url: {engine_url}\n" * (instances - 1)
        return start_gateway(
            procs, work, engine_url, engine=engine, engine_version=engine_version, extra=extra
        )[1]
    finally:
        procs.start = start  # type: ignore[method-assign]


def _floor(procs: ProcessSet, engine_url: str, model: str) -> Target:
    port = free_port()
    argv = [sys.executable, "-m", "bench.perf.floor_relay", str(port), engine_url]
    proc = procs.start("floor", argv)
    proc.wait_http(f"http://127.0.0.1:{port}/health")
    return Target("floor", f"http://127.0.0.1:{port}", model, None, (proc.pid,))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.ab", description=__doc__)
    p.add_argument("--base", required=True, help="the base tree's src/ directory")
    p.add_argument("--new", required=True, help="the new tree's src/ directory")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--duration", type=float, default=2.0, help="seconds per window")
    p.add_argument("--together", action="store_true", help="load both gateways at once")
    p.add_argument("--floor", action="store_true", help="measure floor_relay on ns too")
    p.add_argument(
        "--instances",
        type=int,
        default=1,
        help="serve the engine as this many instances of the deployment (routing among them)",
    )
    p.add_argument(
        "--paced",
        action="store_true",
        help="engine chunks 2 ms apart, 64 at once: streams of 16 and 128 chunks, and 128 "
        "not streamed (the gateway folds them), instead of the usual loads",
    )
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="capyctl-ab-"))
    procs = ProcessSet(work)
    loads = [
        Load("ns", 16, 32, False, args.duration, 0.5, use_wrk=wrk_path() is not None),
        Load("s16", 16, 32, True, args.duration, 0.5),
        Load("s256", 256, 32, True, args.duration, 0.5),
    ]
    if args.paced:
        loads = [
            Load(name, n, 64, stream, args.duration, 0.5, delay_ms=2.0)
            for name, n, stream in (("p16", 16, True), ("p128", 128, True), ("n128", 128, False))
        ]
    # Stopped by a signal, it stops what it started (the gateways and the engine) as it ends.
    old = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        engine, port = start_engine(procs)
        url = f"http://127.0.0.1:{port}"
        n = args.instances
        targets = {
            "base": gateway_from_tree(procs, work / "base", url, args.base, instances=n),
            "new": gateway_from_tree(procs, work / "new", url, args.new, instances=n),
        }
        if args.floor:
            targets["floor"] = _floor(procs, url, targets["new"].model)
        cpu: dict[tuple[str, str], list[float]] = {
            (t, ld.scenario): [] for t in targets for ld in loads
        }
        for i in range(args.rounds):
            order = ("base", "new") if i % 2 == 0 else ("new", "base")
            for ld in loads:
                run = run_wrk if ld.use_wrk else run_sse
                if args.together:
                    half = dataclasses.replace(ld, concurrency=ld.concurrency // 2)
                    with ThreadPoolExecutor(2) as pool:
                        futures = {t: pool.submit(run, targets[t], half, engine.pid) for t in order}
                    measured = [(t, futures[t].result()) for t in order]
                else:
                    measured = [(t, run(targets[t], ld, engine.pid)) for t in order]
                if args.floor and ld.scenario == "ns":
                    measured.append(("floor", run(targets["floor"], ld, engine.pid)))
                for tag, m in measured:
                    if m.cpu_ms_per_req is not None:
                        cpu[(tag, ld.scenario)].append(m.cpu_ms_per_req)
            last = {f"{t}/{s}": round(v[-1], 3) for (t, s), v in cpu.items() if v}
            print(f"round {i + 1}: {last}", flush=True)
        for ld in loads:
            base, new = cpu[("base", ld.scenario)], cpu[("new", ld.scenario)]
            ratios = [n / b for n, b in zip(new, base, strict=False)]
            print(
                f"{ld.scenario}: base {statistics.median(base):.3f} ms, new "
                f"{statistics.median(new):.3f} ms CPU per request; new/base median of pairs "
                f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
            )
        if args.paced:
            per = {t: (statistics.median(cpu[(t, "p128")]) - statistics.median(cpu[(t, "p16")]))
                   / 112 * 1000 for t in ("base", "new")}  # fmt: skip
            print(f"paced streams, CPU per extra chunk: base {per['base']:.1f} us, "
                  f"new {per['new']:.1f} us ({per['new'] / per['base']:.2f}x)")  # fmt: skip
        floor = cpu.get(("floor", "ns"))
        if floor:
            f = statistics.median(floor)
            own = {t: statistics.median(cpu[(t, "ns")]) - f for t in ("base", "new")}
            print(
                f"ns floor {f:.3f} ms; own work above it: base {own['base']:.3f} ms, new "
                f"{own['new']:.3f} ms ({own['new'] / own['base']:.2f}x)"
            )
    finally:
        procs.stop_all()
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
