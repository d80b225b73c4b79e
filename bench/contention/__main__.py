"""``python -m bench.contention``: the three switching policies side by side on the three
scenarios, with the fake engine at vLLM's published sleep-mode costs and with real
llama-servers (see the package's text). ``--quick``: a smoke run of the harness, no figure
to publish (the fake engine at small costs, three-second windows; all three policies on (i),
``cost_aware`` alone on (ii) and (iii)). ``--out FILE`` writes every figure as JSON; the
tables and the goals are printed."""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.perf._procs import ROOT, ProcessSet, tidy

from .engines import Engine, Fake, llama
from .report import POLICIES, goals, tables
from .run import one
from .scenarios import DEFAULT, QUICK, SCENARIOS

LLAMA_TOKENS = 1000
QUICK_FAKE = Fake(sleep_s=0.1, wake_s=0.2, start_s=0.0, gen_s=0.2)


def leftovers(marker: str) -> list[int]:
    """Processes still running whose command line names ``marker`` (this run's engines)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                argv = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in argv:
                found.append(int(proc.name))
    return found


def _meta(args: argparse.Namespace, engines: list[Engine], tag: str) -> dict[str, Any]:
    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    import capyctl_gateway

    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": git("rev-parse", "--short", "HEAD"),
        "gateway_source": str(Path(capyctl_gateway.__file__).resolve().parent),
        "tree_changed": bool(git("status", "--porcelain", "--untracked-files=no")),
        "machine": f"{os.cpu_count()} cores, {platform.platform()}",
        "load_avg_at_start": os.getloadavg(),
        "quick": args.quick,
        "timing": (QUICK if args.quick else DEFAULT).__repr__(),
        "engines": {e.key: e.label for e in engines},
        "marker": tag,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: the fake engine only")
    p.add_argument("--engines", default=None, help="fake,llamacpp (the default; quick: fake)")
    p.add_argument("--scenarios", default="i,ii,iii")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    p.add_argument("--keep", action="store_true", help="keep the gateways' logs")
    args = p.parse_args()
    timing = QUICK if args.quick else DEFAULT
    wanted = (args.engines or ("fake" if args.quick else "fake,llamacpp")).split(",")
    work = Path(tempfile.mkdtemp(prefix="contention-"))
    tag = uuid.uuid4().hex[:8]
    engines: list[Engine] = []
    if "fake" in wanted:
        engines.append(QUICK_FAKE if args.quick else Fake())
    if "llamacpp" in wanted:
        engines.append(llama(work, 200 if args.quick else LLAMA_TOKENS))
    old = {s: signal.signal(s, lambda n, f: sys.exit(128 + n)) for s in (signal.SIGTERM,)}
    procs = ProcessSet(work)
    meta = _meta(args, engines, tag)
    runs: list[dict[str, Any]] = []
    began = time.monotonic()
    plan = [
        (scenario, policy)
        for scenario in SCENARIOS
        if scenario.key in args.scenarios.split(",")
        for policy in args.policies.split(",")
        if not args.quick or scenario.key == "i" or policy == "cost_aware"
    ]
    try:
        for engine in engines:
            for scenario, policy in plan:
                run = one(procs, work, engine, policy, scenario, timing, tag)
                runs.append(run)
                print(json.dumps(_line(run)), file=sys.stderr, flush=True)
    finally:
        procs.stop_all()
        tidy(old, work, keep=args.keep, log=lambda s: print(s, file=sys.stderr))
    doc: dict[str, Any] = {
        "meta": meta | {"wall_s": round(time.monotonic() - began, 1)},
        "goals": goals(runs),
        "runs": runs,
    }
    doc["meta"]["leftovers"] = leftovers(tag)
    if args.out is not None:
        args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(tables(runs, {s.key: s.title for s in SCENARIOS}))
    print("goals:", json.dumps(doc["goals"], indent=1))
    print(f"wall {doc['meta']['wall_s']} s; processes left running: {doc['meta']['leftovers']}")


def _line(run: dict[str, Any]) -> dict[str, Any]:
    keys = ("engine", "scenario", "policy", "per_minute", "activations_per_request", "lost")
    return {k: run[k] for k in keys} | {"run_s": run["run_s"], "switches": run["switches"]}


if __name__ == "__main__":
    main()
