"""The side-by-side benchmark: the fake engine, the gateway in front of it and, where installed,
vllm-router as the peer; every scenario run against each target in turn, round after round.

Run from the repository root: ``.venv/bin/python -m bench.perf.run [--quick] [--rounds 3]``.
Scenarios: non-streamed requests at 32 concurrent (wrk), 16- and 256-chunk streams at 32
concurrent, and time to first token at concurrency 1 (the SSE client). The CPU time of each
target's processes is read from ``/proc`` around each measured window; peak RSS from VmHWM.
It prints a markdown report; ``--json FILE`` writes every measurement. It stops everything it
started, by process group, however it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from ._loads import Load, Measure, Target, run_sse, run_wrk, wrk_path
from ._procfs import peak_rss_kib, rss_kib
from ._procs import Proc, ProcessSet, StartupError, free_port
from ._report import markdown, summarize, write_json

__all__ = ["main"]

CONFIG = """\
deployments:
  - name: bench
    engine: {engine}
    engine_version: "{version}"
    served_model: tiny
    instances:
      - url: {url}
"""
LONG, SHORT = 256, 16


def _peer_bin(explicit: str | None) -> str | None:
    """vllm-router: --peer-bin, $VLLM_ROUTER_BIN, on PATH, or the scratch venv of the docs."""
    for cand in (
        explicit,
        os.environ.get("VLLM_ROUTER_BIN"),
        shutil.which("vllm-router"),
        str(Path(tempfile.gettempdir(), "vllm-router-venv", "bin", "vllm-router")),
    ):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def _check_target(t: Target, *, stream: bool) -> None:
    """One request of each kind must come back whole before anything is timed."""
    body: dict[str, Any] = {"model": t.model, "messages": [], "max_tokens": 4}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {t.key}"} if t.key else {}
    r = httpx.post(f"{t.url}/v1/chat/completions", json=body, headers=headers, timeout=10)
    ok = r.status_code == 200 and (
        r.content.endswith(b"data: [DONE]\n\n") if stream else b'"chat.completion"' in r.content
    )
    if not ok:
        raise StartupError(f"{t.name}: a check request failed: {r.status_code} {r.text[:500]}")


def _machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as fh:
        names = (ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name"))
        model = next(names, "")
    return {
        "cpu": model,
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_at_start": os.getloadavg(),
    }


def _loads(args: argparse.Namespace, use_wrk: bool) -> list[Load]:
    d, w, c = args.duration, args.warmup, args.concurrency
    return [
        Load("ns", args.ns_tokens, c, stream=False, duration_s=d, warmup_s=w, use_wrk=use_wrk),
        Load("s16", SHORT, c, stream=True, duration_s=d, warmup_s=w),
        Load("s256", LONG, c, stream=True, duration_s=d, warmup_s=w),
        Load(
            "ttft",
            SHORT,
            1,
            stream=True,
            duration_s=args.ttft_duration,
            warmup_s=w,
            delay_ms=args.ttft_delay_ms,
        ),
    ]


def start_engine(procs: ProcessSet) -> tuple[Proc, int]:
    """The fake engine on a free loopback port, ready."""
    eport = free_port()
    engine = procs.start(
        "engine",
        [sys.executable, "-m", "bench.perf.fake_engine", "--port", str(eport), "--served", "tiny"],
    )
    engine.wait_http(f"http://127.0.0.1:{eport}/health")
    return engine, eport


def start_gateway(
    procs: ProcessSet,
    work: Path,
    engine_url: str,
    *,
    engine: str = "vllm",
    engine_version: str = "0.31.0",
    extra: str = "",
    args: Sequence[str] = (),
    profile: Path | None = None,
    name: str = "gateway",
) -> tuple[Proc, Target]:
    """capyctl-gateway serving the engine at ``engine_url`` as the deployment ``bench``
    (``extra``: more YAML for its config; ``args``: more options for ``serve``; ``profile``:
    run it under cProfile, written there when it stops), ready."""
    py = sys.executable
    work.mkdir(parents=True, exist_ok=True)
    config = work / "gateway.yaml"
    text = CONFIG.format(engine=engine, version=engine_version, url=engine_url) + extra
    config.write_text(text, encoding="utf-8")
    state = work / "state"
    gport, mport = free_port(), free_port()
    gw_bin = str(Path(py).with_name("capyctl-gateway"))
    gateway = procs.start(
        name,
        [
            *(
                [py, "-m", "cProfile", "-o", str(profile), "-m", "capyctl_gateway.cli"]
                if profile is not None
                else [gw_bin]
                if Path(gw_bin).exists()
                else [py, "-m", "capyctl_gateway.cli"]
            ),
            "serve",
            "--config",
            str(config),
            "--listen",
            f"127.0.0.1:{gport}",
            "--management",
            f"127.0.0.1:{mport}",
            "--state-dir",
            str(state),
            "--log-format",
            "json",
            *args,
        ],
    )
    creds = state / "identity" / "credentials"
    gateway.wait_file(creds)
    key = api_key(creds)
    gateway.wait_http(
        f"http://127.0.0.1:{gport}/v1/models", headers={"Authorization": f"Bearer {key}"}
    )
    pids = (gateway.pid, *_workers(gateway.pid, args))
    return gateway, Target(name, f"http://127.0.0.1:{gport}", "bench", key, pids)


def _workers(pid: int, args: Sequence[str]) -> list[int]:
    """The workers of gateway ``pid`` when ``args`` asks for some: the first answers before
    the last has started, so wait until every one runs."""
    wanted = int(args[list(args).index("--workers") + 1]) if "--workers" in args else 0
    deadline = time.monotonic() + 30
    while len(found := children(pid)) < wanted and time.monotonic() < deadline:
        time.sleep(0.05)  # polling processes that say nothing when they start
    return found


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a gateway's workers)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                found.append(int(proc.name))
    return found


def _serve(args: argparse.Namespace, procs: ProcessSet, work: Path) -> tuple[list[Target], int]:
    """Start the engine, the gateway and the peer; return the targets and the engine's PID."""
    engine, eport = start_engine(procs)
    engine_url = f"http://127.0.0.1:{eport}"
    targets = [Target("direct", engine_url, "tiny", None, ())]
    _, gateway_target = start_gateway(procs, work, engine_url)
    targets.append(gateway_target)
    if args.workers > 1:
        name = f"gateway-w{args.workers}"
        _, team = start_gateway(
            procs, work / name, engine_url, args=["--workers", str(args.workers)], name=name
        )
        targets.append(team)

    peer_bin = None if args.no_peer else _peer_bin(args.peer_bin)
    if peer_bin is not None:
        targets.append(start_peer(procs, peer_bin, engine_url))
    for t in targets:
        _check_target(t, stream=True)
        _check_target(t, stream=False)
    return targets, engine.pid


def start_peer(
    procs: ProcessSet, peer_bin: str, engine_url: str, *more: str, policy: str = "round_robin"
) -> Target:
    """vllm-router in front of the engine at ``engine_url`` (and the ``more`` engines), with
    ``policy`` (round robin by default), ready."""
    pport = free_port()
    peer = procs.start(
        "peer",
        [
            peer_bin,
            "--host",
            "127.0.0.1",
            "--port",
            str(pport),
            "--worker-urls",
            engine_url,
            *more,
            "--policy",
            policy,
            "--log-level",
            "warning",
            "--prometheus-port",
            str(free_port()),
        ],
    )
    peer.wait_http(f"http://127.0.0.1:{pport}/health", timeout_s=60)
    return Target("peer", f"http://127.0.0.1:{pport}", "tiny", None, tuple(peer.pids()))


def api_key(creds: Path) -> str:
    """The ``api_key`` line of a gateway's credentials file."""
    for line in creds.read_text(encoding="utf-8").splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "api_key":
            return value.strip()
    raise StartupError(f"no api_key line in {creds}")


def _run_rounds(
    args: argparse.Namespace,
    targets: list[Target],
    engine_pid: int,
    loads: list[Load],
    log: Callable[[str], None],
) -> list[dict[str, dict[str, Measure]]]:
    rounds: list[dict[str, dict[str, Measure]]] = []
    for i in range(args.rounds):
        r: dict[str, dict[str, Measure]] = {}
        for load in loads:
            for t in targets:
                m = (
                    run_wrk(t, load, engine_pid, threads=args.wrk_threads)
                    if load.use_wrk
                    else run_sse(t, load, engine_pid)
                )
                r.setdefault(load.scenario, {})[t.name] = m
                cpu = m.cpu_ms_per_req
                log(
                    f"round {i + 1} {load.scenario:>4} {t.name:>7}: {m.req_per_s:>9,.0f} req/s"
                    f"  p50 {m.p50_ms or 0:.2f} ms"
                    + (f"  ttft {m.ttft_p50_ms:.3f} ms" if m.ttft_p50_ms is not None else "")
                    + (f"  cpu {cpu:.3f} ms/req" if cpu is not None else "")
                    + (f"  FAILED {m.failed} ({m.first_error})" if m.failed else "")
                )
        rounds.append(r)
    return rounds


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one round, ~1 s per scenario")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per scenario")
    parser.add_argument("--ttft-duration", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before each window")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--ns-tokens", type=int, default=8, help="tokens of a non-streamed answer")
    parser.add_argument(
        "--ttft-delay-ms", type=float, default=1.0, help="engine delay between chunks (TTFT)"
    )
    parser.add_argument("--no-wrk", action="store_true", help="non-streamed load by SSE client")
    parser.add_argument("--wrk-threads", type=int, default=1)
    parser.add_argument("--no-peer", action="store_true", help="skip vllm-router")
    parser.add_argument(
        "--workers", type=int, default=1, help="also a gateway with this many workers (> 1)"
    )
    parser.add_argument("--peer-bin", default=None, help="the vllm-router executable")
    parser.add_argument("--json", type=Path, default=None, help="write every measurement here")
    parser.add_argument("--keep", action="store_true", help="keep the logs' directory")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.duration, args.ttft_duration, args.warmup = 1, 1.0, 1.0, 0.2

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    use_wrk = not args.no_wrk and wrk_path() is not None
    if not args.no_wrk and not use_wrk:
        log("wrk is not installed (apt-get install wrk): the SSE client sends non-streamed load")
    work = Path(tempfile.mkdtemp(prefix="capyctl-bench-"))
    procs = ProcessSet(work)
    # SIGINT too: a runner started in the background inherits it ignored.
    old = {s: signal.signal(s, _terminate) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    started = time.monotonic()
    try:
        targets, engine_pid = _serve(args, procs, work)
        names = [t.name for t in targets]
        log(f"targets: {', '.join(f'{t.name} {t.url}' for t in targets)}; logs in {work}")
        rss0 = {p.name: (rss_kib(p.pid) or 0) / 1024 for p in procs.procs}
        rounds = _run_rounds(args, targets, engine_pid, _loads(args, use_wrk), log)
        by_target = {"direct": "engine", "gateway": "gateway", "peer": "peer"}
        by_target[f"gateway-w{args.workers}"] = f"gateway-w{args.workers}"
        peaks = {p.name: (peak_rss_kib(p.pid) or 0) / 1024 for p in procs.procs}
        meta: dict[str, Any] = {
            "rounds": args.rounds,
            "duration_s": args.duration,
            "ttft_duration_s": args.ttft_duration,
            "warmup_s": args.warmup,
            "concurrency": args.concurrency,
            "ns_tokens": args.ns_tokens,
            "ttft_delay_ms": args.ttft_delay_ms,
            "load_tools": {"ns": "wrk" if use_wrk else "sse_client", "streams": "sse_client"},
            "peak_rss_mib": {t: round(peaks[by_target[t]], 1) for t in names},
            "rss_after_start_mib": {t: round(rss0[by_target[t]], 1) for t in names},
            "processes": {p.name: p.pid for p in procs.procs},
            "machine": _machine(),
        }
        summary = summarize(rounds, names, long=LONG, short=SHORT)
    except StartupError as exc:
        log(f"bench: {exc}")
        return 2
    finally:
        procs.stop_all()
        for s, h in old.items():
            signal.signal(s, h)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    meta["machine"]["load_avg_at_end"] = os.getloadavg()
    report = markdown(summary, meta)
    print(report, flush=True)
    if args.json is not None:
        write_json(args.json, meta, summary, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
