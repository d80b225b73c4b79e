"""The soak: the two rows of the gateway's budget that a short benchmark cannot show, each against
a fresh fake engine and a fresh gateway started as ``bench.perf.run`` starts them.

1. **Slow streams**: N streamed requests (default 1,000) opened all at once and held open together;
   the engine sends one content chunk a second (default 30). A stream is served when it ends in
   ``data: [DONE]`` with exactly that many content chunks. The gateway's RSS (VmRSS) and its open
   file descriptors are read before, every 0.5 s during (and VmHWM at the end), and after.
2. **Requests in a row**: M short requests (default 100,000; half non-streamed, half 2-chunk
   streams) at a moderate concurrency (32), sampled every 5,000 requests, between batches. RSS
   after the warm-up (10,000) is compared with the end; file descriptors at the first sample with
   the end, and idle before the run with idle after it (once the gateway's pooled upstream
   connections have expired).

The gateway is configured with ``queue.max_running_per_deployment`` at least the number of streams
(``--max-running``): with the default of 32 running and 64 waiting, most of a burst of 1,000 is
refused with 429 ``queue_full`` by design (``--max-running 32`` shows it).

Run from the repository root: ``.venv/bin/python -m bench.perf.soak [--quick] [--json FILE]``
(about 2 minutes; ``--quick``: 100 streams of 3 chunks and 2,000 requests, ~12 s). It raises its
own soft file-descriptor limit, which the engine and the gateway inherit, prints a markdown report
and stops everything it started, by process group, however it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import orjson

from ._loads import Target
from ._procfs import cpu_seconds, peak_rss_kib, rss_kib
from ._procs import Proc, ProcessSet, StartupError, tidy
from .run import _check_target, _machine, _terminate, start_engine, start_gateway
from .sse_client import CHAT, ProtocolError, _Exchange, build_request, run_load

__all__ = ["main"]

T = TypeVar("T")
MB_IN_MIB = 1e6 / 2**20
"""The budget speaks of MB (10^6 bytes); RSS is measured in KiB and reported in MiB."""
RSS_BUDGET_MB = 150.0
FLAT_BUDGET = 0.05

Log = Callable[[str], None]


# -- /proc readings ----------------------------------------------------------------------------
def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def nofile_limit(pid: int) -> int | None:
    """The soft ``Max open files`` of a running process."""
    try:
        with open(f"/proc/{pid}/limits", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Max open files"):
                    return int(line.split()[3])
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None
    return None


def _mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


@dataclass
class Sample:
    t_s: float
    rss_mib: float | None
    fds: int | None
    engine_running: float | None = None
    requests: int | None = None


def _sum(read: Callable[[int], int | None], pids: Sequence[int]) -> int | None:
    """``read`` summed over ``pids`` (a gateway with workers is several processes)."""
    got = [read(p) for p in pids]
    return None if any(g is None for g in got) else sum(g for g in got if g is not None)


def _sample(pid: Sequence[int], t0: float, *, requests: int | None = None) -> Sample:
    return Sample(
        round(time.monotonic() - t0, 2),
        _mib(_sum(rss_kib, pid)),
        _sum(fd_count, pid),
        requests=requests,
    )


async def _wait_idle(
    pid: Sequence[int], t0: float, fds: int | None, settle_s: float
) -> Sample | None:
    """Sample once a second until the gateway is back to ``fds`` open files, for at most
    ``settle_s``: idle upstream connections stay pooled for up to twice aiohttp's 15 s."""
    if settle_s <= 0:
        return None
    deadline = time.monotonic() + settle_s
    while True:
        s = _sample(pid, t0)
        if (fds is not None and s.fds is not None and s.fds <= fds) or (
            time.monotonic() >= deadline
        ):
            return s
        await asyncio.sleep(1.0)


def _raise_nofile(need: int, log: Log) -> dict[str, int]:
    """Raise this process's soft RLIMIT_NOFILE towards ``need`` (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        new_hard = hard if hard == resource.RLIM_INFINITY or hard >= need else need
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, new_hard))
        except (ValueError, OSError):
            if hard != resource.RLIM_INFINITY:
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft2, hard2 = resource.getrlimit(resource.RLIMIT_NOFILE)
        log(f"RLIMIT_NOFILE raised from {soft}/{hard} to {soft2}/{hard2} (wanted {need})")
        soft, hard = soft2, hard2
    if soft < need:
        log(f"warning: RLIMIT_NOFILE {soft} < {need}: the streams may fail to connect")
    return {"soft": soft, "hard": hard, "wanted": need}


# -- processes --------------------------------------------------------------------------------
@dataclass
class Served:
    engine: Proc
    gateway: Proc
    target: Target
    engine_url: str


def _serve(
    procs: ProcessSet, work: Path, *, max_running: int, max_waiting: int, workers: int = 1
) -> Served:
    """The fake engine and the gateway in front of it, as ``bench.perf.run`` starts them, with
    the queue sized for the load."""
    engine, eport = start_engine(procs)
    engine_url = f"http://127.0.0.1:{eport}"
    queue = (
        "queue:\n"
        f"  max_running_per_deployment: {max_running}\n"
        f"  max_waiting_per_deployment: {max_waiting}\n"
    )
    more = ["--workers", str(workers)] if workers > 1 else []
    gateway, target = start_gateway(
        procs, work, f"http://127.0.0.1:{eport}", extra=queue, args=more
    )
    _check_target(target, stream=True)
    _check_target(target, stream=False)
    return Served(engine, gateway, target, engine_url)


def _engine_running(engine_url: str) -> float | None:
    """The fake engine's ``vllm:num_requests_running``: streams it holds open right now."""
    try:
        text = httpx.get(engine_url + "/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _run_async(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(coro)
    return uvloop.run(coro)


# -- 1. slow streams --------------------------------------------------------------------------
@dataclass
class StreamOutcome:
    served: bool
    chunks: int
    start: float
    connected: float | None = None
    first: float | None = None
    end: float | None = None
    error: str | None = None


async def _one_stream(
    host: str, port: int, request: bytes, chunks: int, timeout_s: float
) -> StreamOutcome:
    loop = asyncio.get_running_loop()
    out = StreamOutcome(False, 0, time.perf_counter())
    try:
        transport, proto = await loop.create_connection(_Exchange, host, port)
    except OSError as exc:
        out.error = f"connect: {exc!r}"
        return out
    out.connected = time.perf_counter()
    try:
        ok, first, end, body = await asyncio.wait_for(proto.send(request), timeout_s)
    except (ProtocolError, OSError, TimeoutError) as exc:
        out.error = repr(exc)
        return out
    finally:
        transport.close()
    out.first, out.end = first, end
    out.chunks = CHAT.pieces(body)
    out.served = ok and CHAT.whole(body) and out.chunks == chunks
    if not out.served:
        out.error = f"status ok={ok}, {out.chunks} content chunks: {body[:200]!r}"
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3)


async def _slow_streams(args: argparse.Namespace, sv: Served, log: Log) -> dict[str, Any]:
    pid = sv.target.pids  # the gateway's processes: with workers, all of them
    parts = urlsplit(sv.target.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = build_request(
        sv.target.url,
        model=sv.target.model,
        chunks=args.chunks,
        key=sv.target.key,
        delay_ms=args.delay_ms,
    )
    t0 = time.monotonic()
    await asyncio.sleep(1.0)  # let the collector's first polls settle
    before = _sample(pid, t0)
    hwm_before = _mib(_sum(peak_rss_kib, pid))
    samples: list[Sample] = []
    stop = asyncio.Event()

    async def sampler() -> None:
        while not stop.is_set():
            s = _sample(pid, t0)
            s.engine_running = await asyncio.to_thread(_engine_running, sv.engine_url)
            samples.append(s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.sample_s)

    timeout_s = args.chunks * args.delay_ms / 1000 + 60
    cpu0 = cpu_seconds(pid)
    sampling = asyncio.create_task(sampler())
    log(f"streams: opening {args.streams} at once ({args.chunks} chunks, {args.delay_ms:g} ms)")
    w0 = time.perf_counter()
    outcomes = await asyncio.gather(
        *(_one_stream(host, port, request, args.chunks, timeout_s) for _ in range(args.streams))
    )
    wall = time.perf_counter() - w0
    cpu = cpu_seconds(pid) - cpu0
    stop.set()
    await sampling
    hwm = _mib(_sum(peak_rss_kib, pid))
    await asyncio.sleep(2.0)
    after = _sample(pid, t0)
    idle = await _wait_idle(pid, t0, before.fds, args.settle_s)

    served = sum(o.served for o in outcomes)
    errors = [o.error for o in outcomes if o.error]
    firsts = [o.first for o in outcomes if o.first is not None]
    ends = [o.end for o in outcomes if o.end is not None]
    rss_peak_sampled = max((s.rss_mib for s in samples if s.rss_mib is not None), default=None)
    peak = max(x for x in (rss_peak_sampled, hwm) if x is not None)
    rss_before = before.rss_mib or 0.0
    growth_mib = round(peak - rss_before, 1)
    growth_mb = round(growth_mib / MB_IN_MIB, 1)
    sampled_growth = (rss_peak_sampled or rss_before) - rss_before
    fds_peak = max((s.fds for s in samples if s.fds is not None), default=None)
    running_peak = max(
        (s.engine_running for s in samples if s.engine_running is not None), default=None
    )
    log(
        f"streams: {served}/{args.streams} served in {wall:.1f} s; RSS {before.rss_mib} -> "
        f"peak {peak} -> {after.rss_mib} MiB; fds {before.fds} -> {fds_peak} -> {after.fds}"
        + (f" ({idle.fds} after {idle.t_s - after.t_s + 2:.0f} s idle)" if idle else "")
    )
    return {
        "streams": args.streams,
        "chunks": args.chunks,
        "delay_ms": args.delay_ms,
        "served": served,
        "failed": args.streams - served,
        "first_errors": errors[:5],
        "wall_s": round(wall, 2),
        # Every stream had its first content chunk before any stream ended: all were open at once.
        "all_open_together": bool(firsts and ends and max(firsts) < min(ends)),
        "last_first_chunk_s": round(max(firsts) - w0, 3) if firsts else None,
        "first_end_s": round(min(ends) - w0, 3) if ends else None,
        "connects_over_0_5_s": sum(
            1 for o in outcomes if o.connected and o.connected - o.start > 0.5
        ),
        "connect_s": {
            "p50": _pct([o.connected - o.start for o in outcomes if o.connected], 0.5),
            "max": _pct([o.connected - o.start for o in outcomes if o.connected], 1.0),
        },
        "first_chunk_s": {
            "p50": _pct([f - o.start for o in outcomes if (f := o.first)], 0.5),
            "max": _pct([f - o.start for o in outcomes if (f := o.first)], 1.0),
        },
        "stream_s": {
            "p50": _pct([e - o.start for o in outcomes if (e := o.end)], 0.5),
            "max": _pct([e - o.start for o in outcomes if (e := o.end)], 1.0),
        },
        "engine_running_peak": running_peak,
        "rss_mib": {
            "before": before.rss_mib,
            "vmhwm_before": hwm_before,
            "peak_sampled": rss_peak_sampled,
            "vmhwm_after": hwm,
            "peak": peak,
            "after_2s": after.rss_mib,
            "after_idle": idle.rss_mib if idle else None,
        },
        "rss_growth_mib": growth_mib,
        "rss_growth_mb": growth_mb,
        "kib_per_open_stream": round(sampled_growth * 1024 / args.streams, 1),
        "fds": {
            "before": before.fds,
            "peak": fds_peak,
            "after_2s": after.fds,
            "after_idle": idle.fds if idle else None,
        },
        "idle_after_s": round(idle.t_s - after.t_s + 2, 1) if idle else None,
        "gateway_cpu_s": round(cpu, 3),
        "gateway_cpu_ms_per_stream": round(cpu * 1000 / args.streams, 3),
        "settle_s": args.settle_s,
        "samples": [asdict(s) for s in samples],
        "verdict": {
            "all_served": served == args.streams,
            "rss_growth_within_150_mb": growth_mb <= RSS_BUDGET_MB,
        },
    }


# -- 2. requests in a row ---------------------------------------------------------------------
async def _in_a_row(args: argparse.Namespace, sv: Served, log: Log) -> dict[str, Any]:
    pid = sv.target.pids  # the gateway's processes: with workers, all of them
    url, model, key = sv.target.url, sv.target.model, sv.target.key
    ns_req = build_request(url, model=model, chunks=2, key=key, stream=False)
    st_req = build_request(url, model=model, chunks=2, key=key, stream=True)
    c_ns = args.concurrency // 2
    c_st = args.concurrency - c_ns
    t0 = time.monotonic()
    await asyncio.sleep(1.0)
    before = _sample(pid, t0, requests=0)
    samples: list[Sample] = []
    done = completed = failed = wrong_chunks = 0
    first_error: str | None = None
    cpu0, w0 = cpu_seconds(pid), time.perf_counter()
    while done < args.requests:
        n = min(args.sample_every, args.requests - done)
        n_st = n // 2
        r_ns, r_st = await asyncio.gather(
            run_load(url, ns_req, concurrency=c_ns, count=n - n_st, stream=False),
            run_load(url, st_req, concurrency=c_st, count=n_st, stream=True),
        )
        done += n
        completed += r_ns.completed + r_st.completed
        failed += r_ns.failed + r_st.failed
        # one "content" per non-streamed answer; two content chunks per stream
        wrong_chunks += abs(r_ns.content_chunks - r_ns.completed)
        wrong_chunks += abs(r_st.content_chunks - 2 * r_st.completed)
        first_error = first_error or r_ns.first_error or r_st.first_error
        await asyncio.sleep(0.2)  # the gateway sees the client's connections close
        s = _sample(pid, t0, requests=done)
        samples.append(s)
        log(f"in a row: {done:>7,} requests  RSS {s.rss_mib} MiB  fds {s.fds}  failed {failed}")
    wall = time.perf_counter() - w0
    cpu = cpu_seconds(pid) - cpu0
    t_end = time.monotonic() - t0
    idle = await _wait_idle(pid, t0, before.fds, args.settle_s)

    warm = next((s for s in samples if (s.requests or 0) >= args.warmup_requests), samples[0])
    end = samples[-1]
    warm_rss, end_rss = warm.rss_mib or 0.0, end.rss_mib or 0.0
    warm_at = warm.requests or 0
    after_warm = [s.rss_mib for s in samples if s.rss_mib and (s.requests or 0) >= warm_at]
    change = (end_rss - warm_rss) / warm_rss if warm_rss else 0.0
    spread = max((abs(r - warm_rss) for r in after_warm), default=0.0) / (warm_rss or 1.0)
    fd_first, fd_end = samples[0].fds or 0, end.fds or 0
    fd_max = max(s.fds or 0 for s in samples)
    fd_ok = fd_end <= fd_first and (idle is None or (idle.fds or 0) <= (before.fds or 0))
    log(
        f"in a row: {completed:,} served, {failed} failed in {wall:.1f} s; RSS {warm_rss} MiB "
        f"after {warm.requests:,} -> {end_rss} MiB ({change:+.1%}); fds {fd_first} -> {fd_end}"
        + (f", idle {before.fds} -> {idle.fds}" if idle else "")
    )
    return {
        "requests": args.requests,
        "mix": "half non-streamed (2 tokens), half 2-chunk streams",
        "concurrency": args.concurrency,
        "sample_every": args.sample_every,
        "completed": completed,
        "failed": failed,
        "wrong_chunk_counts": wrong_chunks,
        "first_error": first_error,
        "wall_s": round(wall, 1),
        "req_per_s": round(completed / wall, 1) if wall else None,
        "gateway_cpu_ms_per_req": round(cpu * 1000 / completed, 4) if completed else None,
        "rss_mib": {
            "before": before.rss_mib,
            "warm": warm_rss,
            "warm_at_requests": warm.requests,
            "end": end_rss,
            "max_after_warm": max(after_warm, default=None),
            "vmhwm": _mib(_sum(peak_rss_kib, pid)),
            "after_idle": idle.rss_mib if idle else None,
        },
        "rss_change_after_warm": round(change, 4),
        "rss_max_deviation_after_warm": round(spread, 4),
        "fds": {
            "idle_before": before.fds,
            "first_sample": fd_first,
            "max": fd_max,
            "end": fd_end,
            "idle_after": idle.fds if idle else None,
        },
        "idle_after_s": round(idle.t_s - t_end, 1) if idle else None,
        "settle_s": args.settle_s,
        "samples": [asdict(s) for s in samples],
        "verdict": {
            "all_served": failed == 0 and wrong_chunks == 0 and completed == args.requests,
            "rss_flat_within_5pct": abs(change) <= FLAT_BUDGET,
            "no_fd_growth": fd_ok,
        },
    }


# -- report -----------------------------------------------------------------------------------
def _yes(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def markdown(doc: dict[str, Any]) -> str:
    rows = ["| scenario | budget | measured (gateway) | verdict |", "|---|---|---|---|"]
    s = doc.get("streams")
    if s is not None:
        rss, fds, v = s["rss_mib"], s["fds"], s["verdict"]
        rows.append(
            f"| {s['streams']:,} concurrent slow streams ({s['chunks']} chunks, "
            f"{s['delay_ms']:g} ms apart) | all served; RSS growth <= 150 MB | "
            f"{s['served']:,}/{s['streams']:,} served with {s['chunks']} chunks and [DONE]"
            f"{' (all open together)' if s['all_open_together'] else ''}; RSS {rss['before']} → "
            f"peak {rss['peak']} MiB (+{s['rss_growth_mb']} MB, "
            f"{s['kib_per_open_stream']} KiB per open stream), {rss['after_2s']} MiB after; "
            f"fds {fds['before']} → {fds['peak']} → {fds['after_2s']}"
            + (
                f", {fds['after_idle']} after {s['idle_after_s']:g} s idle"
                if fds["after_idle"] is not None
                else ""
            )
            + f" | {_yes(v['all_served'] and v['rss_growth_within_150_mb'])} |"
        )
    r = doc.get("in_a_row")
    if r is not None:
        rss, fds, v = r["rss_mib"], r["fds"], r["verdict"]
        idle = (
            f"; idle before {fds['idle_before']}, {fds['idle_after']} after "
            f"{r['idle_after_s']:g} s idle"
            if fds["idle_after"] is not None
            else ""
        )
        rows.append(
            f"| {r['requests']:,} requests in a row ({r['concurrency']} conc.) | RSS flat within "
            f"5% after warm-up; no file-descriptor growth | {r['completed']:,} served, "
            f"{r['failed']} failed; RSS {rss['warm']} MiB after {rss['warm_at_requests']:,} → "
            f"{rss['end']} MiB at the end ({r['rss_change_after_warm']:+.1%}, max deviation "
            f"{r['rss_max_deviation_after_warm']:.1%}); fds {fds['first_sample']} after the first "
            f"{r['sample_every']:,} → {fds['end']} at the end{idle} | "
            f"{_yes(v['all_served'] and v['rss_flat_within_5pct'] and v['no_fd_growth'])} |"
        )
    lines = ["## Soak (capyctl-gateway)", "", *rows, ""]
    if s is not None:
        lines += [
            f"Slow streams: connect p50/max {s['connect_s']['p50']} / {s['connect_s']['max']} s "
            f"({s['connects_over_0_5_s']} over 0.5 s), "
            f"first content chunk p50/max {s['first_chunk_s']['p50']} / "
            f"{s['first_chunk_s']['max']} s, whole stream p50/max {s['stream_s']['p50']} / "
            f"{s['stream_s']['max']} s; engine held {s['engine_running_peak']} streams at once "
            f"at peak; gateway CPU {s['gateway_cpu_ms_per_stream']} ms per stream.",
            "",
        ]
    if r is not None:
        lines += [
            f"In a row: {r['req_per_s']:,} req/s over {r['wall_s']} s, gateway CPU "
            f"{r['gateway_cpu_ms_per_req']} ms per request; RSS samples (MiB): "
            + ", ".join(f"{x['requests']:,}: {x['rss_mib']}" for x in r["samples"])
            + "; fds: "
            + ", ".join(str(x["fds"]) for x in r["samples"])
            + ".",
            "",
        ]
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.soak", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="100 x 3-chunk streams, 2,000 reqs")
    parser.add_argument("--only", choices=("streams", "in-a-row"), default=None)
    parser.add_argument("--streams", type=int, default=1000, help="concurrent slow streams")
    parser.add_argument("--chunks", type=int, default=30, help="content chunks per slow stream")
    parser.add_argument("--delay-ms", type=float, default=1000.0, help="between slow chunks")
    parser.add_argument("--sample-s", type=float, default=0.5, help="RSS/fd sampling period")
    parser.add_argument(
        "--max-running", type=int, default=None, help="gateway queue (default: the streams)"
    )
    parser.add_argument("--requests", type=int, default=100_000, help="requests in a row")
    parser.add_argument("--concurrency", type=int, default=32, help="for the requests in a row")
    parser.add_argument("--sample-every", type=int, default=5000, help="requests per sample")
    parser.add_argument("--warmup-requests", type=int, default=10_000)
    parser.add_argument(
        "--settle-s",
        type=float,
        default=40.0,
        help="at most this long after each scenario, wait for the gateway's fds to come back "
        "to their idle count (pooled upstream connections expire after 15-30 s)",
    )
    parser.add_argument("--workers", type=int, default=1, help="serve --workers N (> 1)")
    parser.add_argument("--json", type=Path, default=None, help="write every measurement here")
    parser.add_argument("--keep", action="store_true", help="keep the logs' directory")
    args = parser.parse_args(argv)
    if args.quick:
        args.streams, args.chunks, args.requests = 100, 3, 2000
        args.sample_every, args.warmup_requests, args.settle_s = 500, 1000, 0.0
    max_running = args.max_running or max(32, args.streams)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    # The client holds one socket per stream; the gateway two (client side and engine side).
    limits = _raise_nofile(max(4096, 2 * args.streams + 1024), log)
    work = Path(tempfile.mkdtemp(prefix="capyctl-soak-"))
    old = {s: signal.signal(s, _terminate) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    started = time.monotonic()
    doc: dict[str, Any] = {"meta": {"machine": _machine(), "rlimit_nofile": limits}}
    processes: dict[str, dict[str, int]] = {}
    try:
        if args.only in (None, "streams"):
            procs = ProcessSet(work / "streams")
            (work / "streams").mkdir()
            try:
                sv = _serve(
                    procs,
                    work / "streams",
                    max_running=max_running,
                    max_waiting=64,
                    workers=args.workers,
                )
                lim = nofile_limit(sv.gateway.pid)
                doc["meta"]["gateway_nofile_streams"] = lim
                doc["meta"]["max_running_per_deployment"] = max_running
                if lim is not None and lim < 2 * args.streams + 64:
                    log(f"warning: the gateway may open only {lim} files")
                processes["streams"] = {p.name: p.pid for p in procs.procs}
                doc["streams"] = _run_async(_slow_streams(args, sv, log))
            finally:
                procs.stop_all()
        if args.only in (None, "in-a-row"):
            procs = ProcessSet(work / "in_a_row")
            (work / "in_a_row").mkdir()
            try:
                # The gateway's default queue: 32 running, 64 waiting.
                sv = _serve(
                    procs, work / "in_a_row", max_running=32, max_waiting=64, workers=args.workers
                )
                processes["in_a_row"] = {p.name: p.pid for p in procs.procs}
                doc["in_a_row"] = _run_async(_in_a_row(args, sv, log))
            finally:
                procs.stop_all()
    except StartupError as exc:
        log(f"soak: {exc}")
        return 2
    finally:
        tidy(old, work, keep=args.keep, log=log)
    doc["meta"] |= {
        "quick": args.quick,
        "processes": processes,
        "elapsed_s": round(time.monotonic() - started, 1),
        "load_avg_at_end": os.getloadavg(),
    }
    print(markdown(doc), flush=True)
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
