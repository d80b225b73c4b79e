"""Running one load against one target: the SSE client or wrk, each in its own process, with the
target's CPU time read from ``/proc`` around the measured window."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from ._procfs import cpu_seconds
from ._procs import ROOT

__all__ = ["Load", "Measure", "Target", "run_sse", "run_wrk", "wrk_path"]

WRK_SCRIPT = Path(__file__).with_name("wrk_post.lua")
PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    model: str
    key: str | None
    pids: tuple[int, ...]
    """The processes whose CPU is the target's own (empty for direct: the engine is counted
    separately)."""


@dataclass(frozen=True)
class Load:
    scenario: str
    chunks: int
    concurrency: int
    stream: bool
    duration_s: float
    warmup_s: float
    delay_ms: float | None = None
    use_wrk: bool = False
    api: str = "chat"
    """What the SSE client asks: ``chat`` or ``responses`` (wrk sends chat only)."""


@dataclass
class Measure:
    target: str
    scenario: str
    tool: str
    completed: int
    failed: int
    window_s: float
    req_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    cpu_s: float | None
    """The target's own CPU during the window (None for direct)."""
    engine_cpu_s: float
    client_cpu_s: float | None
    content_chunks: int | None
    first_error: str | None
    cpu_by_pid: dict[str, float] | None = None
    """Each of the target's processes' CPU during the window (the SSE client's loads)."""

    @property
    def cpu_ms_per_req(self) -> float | None:
        if self.cpu_s is None or not self.completed:
            return None
        return self.cpu_s * 1000 / self.completed

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cpu_ms_per_req"] = self.cpu_ms_per_req
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def wrk_path() -> str | None:
    return shutil.which("wrk")


def _run(argv: list[str], env: dict[str, str] | None, timeout_s: float) -> str:
    """Run a load process in its own session; kill its group if it overruns."""
    popen = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, err = popen.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill(popen)
        raise RuntimeError(f"{argv[0]} overran {timeout_s:.0f} s") from None
    except BaseException:  # interrupted: the load must not outlive the runner
        _kill(popen)
        raise
    if popen.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])}... exited {popen.returncode}: {err.decode()}")
    return out.decode()


def _kill(popen: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, signal.SIGKILL)
    popen.communicate()


def run_sse(target: Target, load: Load, engine_pid: int) -> Measure:
    argv = [
        sys.executable,
        "-m",
        "bench.perf.sse_client",
        "--url",
        target.url,
        "--model",
        target.model,
        "-c",
        str(load.concurrency),
        "-d",
        str(load.duration_s),
        "--warmup",
        str(load.warmup_s),
        "--chunks",
        str(load.chunks),
        "--cpu-pid",
        str(engine_pid),
    ]
    for pid in target.pids:
        argv += ["--cpu-pid", str(pid)]
    if target.key:
        argv.append(f"--key={target.key}")  # a key may begin with "-"
    if load.delay_ms is not None:
        argv += ["--delay-ms", str(load.delay_ms)]
    if not load.stream:
        argv.append("--no-stream")
    argv += ["--api", load.api]
    timeout = load.warmup_s + load.duration_s + 60
    doc = orjson.loads(_run(argv, None, timeout).strip().splitlines()[-1])
    cpu = doc["cpu_s"]
    return Measure(
        target=target.name,
        scenario=load.scenario,
        tool="sse_client",
        completed=doc["completed"],
        failed=doc["failed"],
        window_s=doc["window_s"],
        req_per_s=doc["req_per_s"],
        p50_ms=doc["total_ms"]["p50"],
        p99_ms=doc["total_ms"]["p99"],
        ttft_p50_ms=doc["ttft_ms"]["p50"] if load.stream else None,
        ttft_p99_ms=doc["ttft_ms"]["p99"] if load.stream else None,
        cpu_s=sum(cpu[str(p)] for p in target.pids) if target.pids else None,
        engine_cpu_s=cpu[str(engine_pid)],
        client_cpu_s=doc["client_cpu_s"],
        content_chunks=doc["content_chunks"],
        first_error=doc["first_error"],
        cpu_by_pid={str(p): cpu[str(p)] for p in target.pids},
    )


def wrk_body(model: str, chunks: int) -> str:
    return orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": chunks,
        }
    ).decode()


def run_wrk(target: Target, load: Load, engine_pid: int, *, threads: int = 1) -> Measure:
    """wrk takes whole seconds; a warm-up run comes first when ``load.warmup_s`` > 0."""
    wrk = wrk_path()
    if wrk is None:
        raise RuntimeError("wrk is not installed")
    env = dict(os.environ)
    env["BENCH_WRK_BODY"] = wrk_body(target.model, load.chunks)
    env["BENCH_WRK_KEY"] = target.key or ""
    url = target.url + PATH

    def argv(seconds: int) -> list[str]:
        return [
            wrk,
            f"-t{threads}",
            f"-c{load.concurrency}",
            f"-d{seconds}s",
            "--timeout",
            "10s",
            "-s",
            str(WRK_SCRIPT),
            url,
        ]

    if load.warmup_s > 0:
        _run(argv(max(1, math.ceil(load.warmup_s))), env, load.warmup_s + 30)
    seconds = max(1, round(load.duration_s))
    own0 = cpu_seconds(target.pids)
    eng0 = cpu_seconds([engine_pid])
    t0 = time.perf_counter()
    out = _run(argv(seconds), env, seconds + 30)
    wall = time.perf_counter() - t0
    own = cpu_seconds(target.pids) - own0
    eng = cpu_seconds([engine_pid]) - eng0
    line = next((x for x in out.splitlines() if x.startswith("BENCH_WRK ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary:\n{out}")
    doc = orjson.loads(line.removeprefix("BENCH_WRK "))
    failed = sum(
        doc[k]
        for k in ("connect_errors", "read_errors", "write_errors", "status_errors", "timeouts")
    )
    completed = doc["requests"] - doc["status_errors"]
    window = doc["duration_us"] / 1e6
    return Measure(
        target=target.name,
        scenario=load.scenario,
        tool="wrk",
        completed=completed,
        failed=failed,
        window_s=window,
        req_per_s=round(completed / window, 1) if window else 0.0,
        p50_ms=doc["p50_us"] / 1000,
        p99_ms=doc["p99_us"] / 1000,
        ttft_p50_ms=None,
        ttft_p99_ms=None,
        cpu_s=own if target.pids else None,
        engine_cpu_s=eng,
        client_cpu_s=None,
        content_chunks=None,
        first_error=None if not failed else f"wrk counted {failed} errors ({wall:.1f} s run)",
    )
