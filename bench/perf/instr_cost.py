"""Instructions per request of a gateway tree, counted by valgrind's callgrind: a figure that
does not move with what else the machine runs (see `ab` for time, which does).

Each tree's gateway runs under ``valgrind --tool=callgrind`` in front of the fast fake engine
(on real time, outside valgrind); the SSE client warms it up, the counters are zeroed
(``callgrind_control -z``), exactly ``--count`` requests of each load are sent, and the counts
dumped (``callgrind_control -d``). What the gateway does on its own (the collector's poll
once a second, its watches) is counted first, in an idle window, and taken out of each load's
total at that rate for the load's time: under valgrind a request takes milliseconds, and a
second's background work would otherwise be charged to a few hundred requests.
Run from the repository root::

    .venv/bin/python -m bench.perf.instr_cost --tree base=/tmp/base/src --tree new=src

It prints one line per tree and load and keeps each dump in ``--out`` (for
``callgrind_annotate``: which C functions, the interpreter's among them, take the difference).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from ._procs import ProcessSet, free_port
from .run import CONFIG, api_key, start_engine

__all__ = ["main"]

LOADS = {"ns": (16, False), "s16": (16, True), "s256": (256, True)}
"""Each load: content chunks, and whether the client asks for a stream."""


def _client(url: str, key: str, chunks: int, stream: bool, count: int) -> None:
    argv = [
        sys.executable,
        "-m",
        "bench.perf.sse_client",
        "--url",
        url,
        "--model",
        "bench",
        f"--key={key}",
        "-c",
        "4",
        "-n",
        str(count),
        "--chunks",
        str(chunks),
    ]
    if not stream:
        argv.append("--no-stream")
    out = subprocess.run(argv, check=True, capture_output=True, timeout=1800).stdout
    doc = orjson.loads(out.strip().splitlines()[-1])
    if doc["failed"] or doc["completed"] != count:
        raise RuntimeError(f"load failed: {doc}")


def _zero(pid: str) -> None:
    subprocess.run(["callgrind_control", "-z", pid], check=True, capture_output=True)


def _dump(pid: str, name: str, out: Path, tree: str) -> int:
    """Dump the counts since the last zero as ``callgrind.<tree>.<name>``; their total."""
    subprocess.run(["callgrind_control", "-d", name, pid], check=True, capture_output=True)
    files = sorted(out.glob(f"callgrind.{tree}.{pid}.*"), key=lambda p: p.stat().st_mtime)
    text = files[-1].read_text("utf-8", "replace")
    total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
    if total is None:
        raise RuntimeError(f"no total in {files[-1]}")
    files[-1].rename(out / f"callgrind.{tree}.{name}")
    return int(total.group(1))


def _measure(
    procs: ProcessSet,
    work: Path,
    engine_url: str,
    src: str,
    *,
    count: int,
    loads: list[str],
    out: Path,
    idle_s: float,
) -> dict[str, float]:
    work.mkdir(parents=True)
    config = work / "gateway.yaml"
    config.write_text(CONFIG.format(engine="vllm", version="0.31.0", url=engine_url), "utf-8")
    gport, mport = free_port(), free_port()
    dump = out / f"callgrind.{work.name}.%p"
    argv = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={dump}",
        sys.executable,
        "-m",
        "capyctl_gateway.cli",
        "serve",
        "--config",
        str(config),
        "--listen",
        f"127.0.0.1:{gport}",
        "--management",
        f"127.0.0.1:{mport}",
        "--state-dir",
        str(work / "state"),
        "--log-format",
        "json",
    ]
    # One hash seed for every tree: str hashes decide dicts' and sets' layouts, and so some
    # of the instructions (about 1% between two runs of one tree otherwise).
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()), PYTHONHASHSEED="0")
    gateway = procs.start(f"gateway-{work.name}", argv, env=env)
    creds = work / "state" / "identity" / "credentials"
    gateway.wait_file(creds, timeout_s=300)
    key = api_key(creds)
    url = f"http://127.0.0.1:{gport}"
    gateway.wait_http(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout_s=300)
    pid = str(gateway.pid)
    _client(url, key, 16, False, 20)
    start = time.monotonic()
    _zero(pid)
    time.sleep(idle_s)
    idle = _dump(pid, "idle", out, work.name) / (time.monotonic() - start)
    result: dict[str, float] = {"idle_per_s": idle}
    for name in loads:
        chunks, stream = LOADS[name]
        _client(url, key, chunks, stream, max(50, count // 5))  # warm-up
        start = time.monotonic()
        _zero(pid)
        _client(url, key, chunks, stream, count)
        total = _dump(pid, name, out, work.name)
        result[name] = (total - idle * (time.monotonic() - start)) / count
    procs.stop(gateway)
    return result


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.instr_cost", description=__doc__)
    p.add_argument("--tree", action="append", required=True, help="NAME=SRC, once a tree")
    p.add_argument("--count", type=int, default=400, help="requests of each load measured")
    p.add_argument("--load", action="append", choices=sorted(LOADS), help="once a load (all)")
    p.add_argument("--idle", type=float, default=10.0, help="seconds of the idle window")
    p.add_argument("--out", default=None, help="where the dumps go (a new folder by default)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="capyctl-instr-"))
    out = Path(args.out) if args.out else work / "dumps"
    out.mkdir(parents=True, exist_ok=True)
    procs = ProcessSet(work)
    signal.signal(signal.SIGTERM, _stop)  # the gateways and the engine stop with it
    try:
        _, port = start_engine(procs)
        for tree in args.tree:
            name, src = tree.split("=", 1)
            url = f"http://127.0.0.1:{port}"
            loads = args.load or list(LOADS)
            r = _measure(
                procs,
                work / name,
                url,
                src,
                count=args.count,
                loads=loads,
                out=out,
                idle_s=args.idle,
            )
            idle = r.pop("idle_per_s")
            line = ", ".join(f"{k} {v / 1000:,.1f} k" for k, v in r.items())
            print(
                f"{name}: instructions per request: {line} (idle: {idle / 1000:,.0f} k a second, "
                "taken out)",
                flush=True,
            )
    finally:
        procs.stop_all()
    print(f"dumps in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
