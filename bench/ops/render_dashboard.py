"""Draw the Grafana dashboard of docs/ops/ from a real run, without Grafana.

Grafana cannot be used here (its licence, and no package installs it), so this script does what
Grafana would do with the dashboard's JSON, against real processes on loopback:

1. starts a fault-injecting engine (``bench.perf.fault_engine``) and a ``capyctl-gateway`` in front
   of it as deployment ``bench`` (``bench.perf.run.start_gateway``), with ``serve --metrics`` on
   its own port and a second deployment, ``launched``, whose engine (``bench.perf.fake_engine``)
   the gateway starts on request and stops when idle, under a memory budget;
2. starts a real Prometheus (a config it writes, scraping that ``/metrics`` every second with the
   gateway's key);
3. drives a few minutes of mixed load in phases of changing concurrency (``--load-s``, default
   180 s): streamed and non-streamed requests drawn as the fault soak draws them
   (``bench.perf.faults``: mostly served, some with a client hang-up in every phase, some with an
   engine that is slow, hangs, dies or only pings), a burst past the queue's room (429
   ``queue_full``), requests for the launched deployment in two waves (so it starts, stops when
   idle, and starts again), and a steady trickle of refusals (unknown model, wrong key, invalid
   body); then waits ``--settle-s`` with no load;
4. runs every panel's queries against Prometheus's HTTP API (``/api/v1/query_range``, step 2 s,
   ``$__rate_interval`` as 15 s, ``$deployment`` as ``.*``, i.e. "All"), and draws the panels
   into one PNG laid out by their ``gridPos``, titled as in the JSON, each series named by its
   ``legendFormat``. A panel whose queries return nothing says "No data".

What it needs beyond the project's venv (neither is a project dependency):

* Prometheus on PATH (or ``--prometheus PATH``): ``apt-get install prometheus`` (2.42 tested);
* matplotlib: ``.venv/bin/pip install matplotlib``, or into a directory of its own,
  ``.venv/bin/pip install --target /tmp/mpl matplotlib`` and ``PYTHONPATH=/tmp/mpl``.

Run from the repository root: ``.venv/bin/python -m bench.ops.render_dashboard`` (about 3.5
minutes; writes docs/ops/dashboard.png, or ``--out FILE``). ``--json FILE`` keeps the run's record
(the request counts, every query and Prometheus's answer); ``--from-json FILE`` draws a record
again without running anything; ``--keep`` keeps the processes' logs. It stops everything it
started, by process group, however it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ..perf._procs import ROOT, ProcessSet, StartupError, free_port
from ..perf.faults import Ctx, Plan, make_plans, run_one
from ..perf.run import _check_target, _terminate, start_gateway
from ..perf.soak import _run_async

__all__ = ["main"]

DASHBOARD = ROOT / "docs" / "ops" / "capyctl-gateway.grafana.json"
OUT = ROOT / "docs" / "ops" / "dashboard.png"
RATE_INTERVAL = "15s"
STEP_S = 2.0
SCRAPE_S = 1.0
LAUNCHED = "launched"
Log = Callable[[str], None]

# The launched deployment's engine: the fast fake engine, less the flag the gateway forces on a
# vLLM command line (the fake engine does not know it).
_LAUNCH_SNIPPET = (
    "import sys; from bench.perf.fake_engine import main; "
    "main([a for a in sys.argv[1:] if a != '--enable-per-request-metrics'])"
)


@dataclass(frozen=True)
class Phase:
    """A stretch of the load: until ``until`` (a fraction of the load's length), ``clients``
    concurrent clients on deployment ``bench``; clients on ``launched`` when ``launched``."""

    until: float
    clients: int
    launched: bool
    think_s: tuple[float, float] = (0.2, 0.5)


SCHEDULE = (
    Phase(0.17, 6, True),
    Phase(0.22, 0, True),  # a lull: the engine goes idle, cut requests settle
    Phase(0.42, 24, False),  # twice the running slots: a queue; `launched` stops when idle
    Phase(0.46, 0, False),
    Phase(0.56, 48, False, (0.05, 0.15)),  # past the queue's room: 429 queue_full
    Phase(0.62, 0, True),  # `launched` is started again
    Phase(0.85, 12, True),
    Phase(1.0, 3, False),
)
MAX_RUNNING = 12
MAX_WAITING = 24
FAULTY_SHARE = 0.3
"""The share of requests on ``bench`` drawn from the fault soak's whole mix (hang-ups, engine
faults); the rest are its plain served kind, with 10-30 ms between chunks."""


def _extra_config() -> str:
    """YAML after run.CONFIG (whose last line is deployment ``bench``'s instance): a second,
    launched deployment, a memory budget, and a small queue so that the burst overflows it."""
    command = [sys.executable, "-c", _LAUNCH_SNIPPET, "--served", LAUNCHED]
    command += ["--chunks", "12", "--ttft-ms", "40", "--delay-ms", "15"]
    return (
        f"  - name: {LAUNCHED}\n"
        "    engine: vllm\n"
        '    engine_version: "0.31.0"\n'
        f"    served_model: {LAUNCHED}\n"
        "    memory: {ready: 6GiB, parked: 0}\n"
        "    lifecycle:\n"
        "      ready_idle_timeout: 15s\n"
        "    instances:\n"
        "      - launch:\n"
        f"          command: {json.dumps(command)}\n"
        f"          env: {json.dumps({'PYTHONPATH': str(ROOT)})}\n"
        "          startup_timeout: 30s\n"
        "resources:\n"
        "  memory_budget: 16GiB\n"
        "queue:\n"
        "  request_deadline: 5s\n"
        "  stream_idle_timeout: 1.5s\n"
        f"  max_running_per_deployment: {MAX_RUNNING}\n"
        f"  max_waiting_per_deployment: {MAX_WAITING}\n"
        f"  max_waiting_total: {4 * MAX_WAITING}\n"
    )


# -- the processes ----------------------------------------------------------------------------
@dataclass
class Served:
    ctx: Ctx
    gateway_url: str
    key: str
    prometheus_url: str


def _serve(procs: ProcessSet, work: Path, prometheus: str, log: Log) -> Served:
    eport = free_port()
    engine = procs.start(
        "engine",
        [sys.executable, "-m", "bench.perf.fault_engine", "--port", str(eport), "--served", "tiny"],
    )
    engine.wait_http(f"http://127.0.0.1:{eport}/health")
    mport = free_port()
    _, target = start_gateway(
        procs,
        work,
        f"http://127.0.0.1:{eport}",
        extra=_extra_config(),
        args=["--metrics", f"127.0.0.1:{mport}"],
    )
    _check_target(target, stream=True)
    _check_target(target, stream=False)
    key = target.key or ""
    log(f"gateway at {target.url}, its metrics at 127.0.0.1:{mport}")

    prom = work / "prometheus"
    prom.mkdir()
    (prom / "key").write_text(key, encoding="utf-8")
    (prom / "prometheus.yml").write_text(
        "global:\n"
        f"  scrape_interval: {SCRAPE_S:g}s\n"
        f"  scrape_timeout: {SCRAPE_S:g}s\n"
        "scrape_configs:\n"
        "  - job_name: capyctl-gateway\n"
        "    metrics_path: /metrics\n"
        # The gateway's own `instance` label (the instance's index) is what the panels mean;
        # without this Prometheus renames it `exported_instance` and puts its target there.
        "    honor_labels: true\n"
        "    authorization:\n"
        f"      credentials_file: {prom / 'key'}\n"
        "    static_configs:\n"
        f'      - targets: ["127.0.0.1:{mport}"]\n',
        encoding="utf-8",
    )
    pport = free_port()
    server = procs.start(
        "prometheus",
        [
            prometheus,
            f"--config.file={prom / 'prometheus.yml'}",
            f"--storage.tsdb.path={prom / 'data'}",
            f"--web.listen-address=127.0.0.1:{pport}",
            "--log.level=warn",
        ],
    )
    purl = f"http://127.0.0.1:{pport}"
    server.wait_http(f"{purl}/-/ready", timeout_s=60)
    deadline = time.monotonic() + 30
    while True:  # the first scrape, answered
        server.check_alive()
        targets = httpx.get(f"{purl}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        if targets and all(t["health"] == "up" for t in targets):
            break
        if time.monotonic() > deadline:
            raise StartupError(f"prometheus: the gateway's /metrics is not up: {targets}")
        time.sleep(0.5)
    log(f"prometheus {purl} scrapes it every {SCRAPE_S:g} s")
    parts = httpx.URL(target.url)
    ctx = Ctx(parts.host, parts.port or 80, key, eport, timeout_s=30.0)
    return Served(ctx, target.url, key, purl)


# -- the load ---------------------------------------------------------------------------------
class Plans:
    """Plans for deployment ``bench``: from the fault soak's mix (``FAULTY_SHARE``) or its plain
    served kind, with ids unique over the run (the fault engine keys requests by id)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_id = 0
        self.faulty: Iterator[Plan] = iter(())
        self.plain: Iterator[Plan] = iter(())

    def draw(self) -> Plan:
        faulty = self.rng.random() < FAULTY_SHARE
        source = self.faulty if faulty else self.plain
        plan = next(source, None)
        if plan is None:
            seed = self.rng.randrange(2**31)
            source = iter(make_plans(1000, seed, None if faulty else ["none/normal"]))
            if faulty:
                self.faulty = source
            else:
                self.plain = source
            plan = next(source)
        self.next_id += 1
        if faulty:
            return dataclasses.replace(plan, rid=self.next_id)
        # plain streams of a few hundred ms, as a small model's answers take
        gap = self.rng.choice((10.0, 20.0, 30.0))
        return dataclasses.replace(plan, rid=self.next_id, gap_ms=gap)


def _phase(t0: float, load_s: float) -> Phase | None:
    frac = (time.monotonic() - t0) / load_s
    return next((p for p in SCHEDULE if frac < p.until), None)


async def _drive(sv: Served, load_s: float, seed: int, log: Log) -> dict[str, Counter[str]]:
    rng = random.Random(seed)
    plans = Plans(seed)
    tally: dict[str, Counter[str]] = {"bench": Counter(), LAUNCHED: Counter(), "refused": Counter()}
    url = f"{sv.gateway_url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {sv.key}"}
    messages = [{"role": "user", "content": "dashboard"}]
    t0 = time.monotonic()

    async def bench_client(i: int) -> None:
        while (ph := _phase(t0, load_s)) is not None:
            if i >= ph.clients:
                await asyncio.sleep(0.25)
                continue
            result = await run_one(sv.ctx, plans.draw())
            tally["bench"][result.label] += 1
            await asyncio.sleep(rng.uniform(*ph.think_s))

    async def launched_client(client: httpx.AsyncClient) -> None:
        while (ph := _phase(t0, load_s)) is not None:
            if not ph.launched:
                await asyncio.sleep(0.25)
                continue
            body: dict[str, Any] = {
                "model": LAUNCHED,
                "messages": messages,
                "max_tokens": rng.randint(4, 24),
            }
            stream, hang_up = rng.random() < 0.6, rng.random() < 0.15
            try:
                if stream:
                    body["stream"] = True
                    async with client.stream("POST", url, json=body, headers=auth) as r:
                        async for _ in r.aiter_bytes():
                            if hang_up:  # closing the unread response closes the connection
                                break
                    label = "hung up" if hang_up else f"HTTP {r.status_code}"
                else:
                    label = f"HTTP {(await client.post(url, json=body, headers=auth)).status_code}"
            except httpx.HTTPError as exc:
                label = type(exc).__name__
            tally[LAUNCHED][label] += 1
            await asyncio.sleep(rng.uniform(0.3, 0.8))

    async def refusals(client: httpx.AsyncClient) -> None:
        kinds: list[tuple[dict[str, Any], dict[str, str]]] = [
            ({"model": "no-such-model", "messages": messages}, auth),
            ({"model": "bench", "messages": messages}, {"Authorization": "Bearer wrong-key"}),
            ({"model": "bench", "messages": "not a list"}, auth),
        ]
        n = 0
        while _phase(t0, load_s) is not None:
            body, headers = kinds[n % len(kinds)]
            n += 1
            try:
                r = await client.post(url, json=body, headers=headers)
                tally["refused"][f"HTTP {r.status_code} {r.json().get('code', '?')}"] += 1
            except (httpx.HTTPError, ValueError) as exc:
                tally["refused"][type(exc).__name__] += 1
            await asyncio.sleep(1.0)

    async def progress() -> None:
        last: Phase | None = None
        while (ph := _phase(t0, load_s)) is not None:
            if ph != last:
                done = sum(sum(c.values()) for c in tally.values())
                log(
                    f"{time.monotonic() - t0:5.0f} s: {ph.clients} clients on bench, "
                    f"{LAUNCHED} {'on' if ph.launched else 'off'} ({done:,} requests so far)"
                )
                last = ph
            await asyncio.sleep(0.5)

    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        await asyncio.gather(
            progress(),
            refusals(client),
            *(launched_client(client) for _ in range(2)),
            *(bench_client(i) for i in range(max(p.clients for p in SCHEDULE))),
        )
    return tally


# -- the queries ------------------------------------------------------------------------------
@dataclass
class Series:
    legend: str
    times: list[float]
    values: list[float]


@dataclass
class PanelData:
    title: str
    unit: str
    grid: dict[str, int]
    series: list[Series]
    errors: list[str]


def _expr(expr: str) -> str:
    return (
        expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace("${deployment}", ".*")
        .replace("$deployment", ".*")
    )


def _legend(fmt: str, metric: dict[str, str]) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt)
    return " ".join(text.split()) or json.dumps(metric)


def fetch(
    prometheus_url: str, dashboard: dict[str, Any], start: float, end: float
) -> list[dict[str, Any]]:
    """Prometheus's answer to every panel's every target over [start, end], in order."""
    answers: list[dict[str, Any]] = []
    with httpx.Client(base_url=prometheus_url, timeout=30) as client:
        for p in dashboard["panels"]:
            for t in p["targets"]:
                q = _expr(t["expr"])
                params: dict[str, str | float] = {
                    "query": q,
                    "start": start,
                    "end": end,
                    "step": STEP_S,
                }
                doc = client.get("/api/v1/query_range", params=params).json()
                answers.append({"panel": p["title"], "query": q, "answer": doc})
    return answers


def panels_from(dashboard: dict[str, Any], answers: list[dict[str, Any]]) -> list[PanelData]:
    """The dashboard's panels with their series, from ``fetch``'s answers."""
    panels: list[PanelData] = []
    it = iter(answers)
    for p in dashboard["panels"]:
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        data = PanelData(p["title"], unit, p["gridPos"], [], [])
        for t in p["targets"]:
            got = next(it)
            doc = got["answer"]
            if got["panel"] != p["title"] or got["query"] != _expr(t["expr"]):
                raise ValueError(f"the answers do not match the dashboard at {p['title']!r}")
            if doc.get("status") != "success":
                data.errors.append(f"{got['query']}: {doc.get('error')}")
                continue
            for res in doc["data"]["result"]:
                points = [(float(ts), float(v)) for ts, v in res["values"]]
                points = [(ts, v) for ts, v in points if math.isfinite(v)]
                if points:
                    legend = _legend(t.get("legendFormat", ""), res["metric"])
                    times, values = (list(x) for x in zip(*points, strict=True))
                    data.series.append(Series(legend, times, values))
        panels.append(data)
    return panels


# -- the picture ------------------------------------------------------------------------------
BG, PANEL, BORDER = "#111217", "#181b1f", "#2c3036"
TEXT, MUTED, GRID = "#ccccdc", "#8e8e9e", "#2a2d33"
COLOURS = (
    "#73bf69",
    "#5794f2",
    "#ff9830",
    "#b877d9",
    "#f2495c",
    "#f2cc0c",
    "#8ab8ff",
    "#ffcb7d",
    "#96d98d",
    "#ca95e5",
)
WIDTH_IN, ROW_IN, HEAD_IN, DPI = 16.0, 0.34, 0.95, 80


def _num(v: float) -> str:
    a = abs(v)
    if a >= 1e9:
        return f"{v / 1e9:.3g}G"
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e3:
        return f"{v / 1e3:.3g}K"
    return f"{v:.3g}"


def _tick(unit: str, v: float) -> str:
    if v == 0:
        return "0"
    if unit == "s":
        if abs(v) < 1e-3:
            return f"{v * 1e6:.3g} µs"
        if abs(v) < 1:
            return f"{v * 1e3:.3g} ms"
        return f"{v:.3g} s"
    if unit == "reqps":
        return f"{_num(v)} req/s"
    return _num(v)


def _with_gaps(s: Series) -> tuple[list[float], list[float]]:
    """The series with a NaN where Prometheus had no point, so the line breaks there."""
    xs: list[float] = []
    ys: list[float] = []
    for i, (x, y) in enumerate(zip(s.times, s.values, strict=True)):
        if i and x - s.times[i - 1] > 1.5 * STEP_S:
            xs.append(x - STEP_S)
            ys.append(math.nan)
        xs.append(x)
        ys.append(y)
    return xs, ys


def _time_ticks(start: float, end: float) -> list[float]:
    every = next((e for e in (15, 30, 60, 120, 300, 600, 1800) if (end - start) / e <= 7), 3600)
    first = math.ceil(start / every) * every
    return [float(t) for t in range(first, int(end) + 1, every)]


def render(
    panels: list[PanelData], out: Path, *, title: str, subtitle: str, start: float, end: float
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import FuncFormatter

    rows = max(p.grid["y"] + p.grid["h"] for p in panels)
    height = HEAD_IN + rows * ROW_IN + 0.1
    fig = Figure(figsize=(WIDTH_IN, height), dpi=DPI, facecolor=BG)
    fig.text(0.15 / WIDTH_IN, 1 - 0.12 / height, title, color=TEXT, fontsize=15, va="top")
    fig.text(0.15 / WIDTH_IN, 1 - 0.45 / height, subtitle, color=MUTED, fontsize=9, va="top")
    col = WIDTH_IN / 24
    ticks = _time_ticks(start, end)
    gap = 0.05

    def fx(inches: float) -> float:
        return inches / WIDTH_IN

    def fy(inches_from_top: float) -> float:
        return 1 - inches_from_top / height

    for p in panels:
        g = p.grid
        left, top = g["x"] * col + gap, HEAD_IN + g["y"] * ROW_IN + gap
        w, h = g["w"] * col - 2 * gap, g["h"] * ROW_IN - 2 * gap
        fig.add_artist(
            Rectangle(
                (fx(left), fy(top + h)),
                fx(w),
                h / height,
                transform=fig.transFigure,
                facecolor=PANEL,
                edgecolor=BORDER,
                linewidth=1,
                zorder=-1,  # under the axes
            )
        )
        fig.text(fx(left + 0.12), fy(top + 0.1), p.title, color=TEXT, fontsize=10, va="top")
        if not p.series:
            note = "No data" if not p.errors else "Query error"
            fig.text(fx(left + w / 2), fy(top + h / 2), note, color=MUTED, fontsize=13, ha="center")
            continue
        longest = max(len(s.legend) for s in p.series)
        ncol = max(1, min(len(p.series), int((w - 0.3) // (0.07 * longest + 0.45))))
        legend_h = math.ceil(len(p.series) / ncol) * 0.19
        ax_left, ax_right, ax_top, ax_bottom = 0.8, 0.2, 0.42, 0.3 + legend_h
        ax = fig.add_axes(
            (
                fx(left + ax_left),
                fy(top + h - ax_bottom),
                fx(w - ax_left - ax_right),
                (h - ax_top - ax_bottom) / height,
            )
        )
        ax.set_facecolor(PANEL)
        for side in ("top", "right", "left", "bottom"):
            ax.spines[side].set_visible(False)
        ax.grid(True, color=GRID, linewidth=0.8)
        ax.tick_params(colors=MUTED, labelsize=7.5, length=0)
        top_value = 0.0
        for i, s in enumerate(p.series):
            colour = COLOURS[i % len(COLOURS)]
            xs, ys = _with_gaps(s)
            ax.plot(xs, ys, color=colour, linewidth=1.3, label=s.legend)
            ax.fill_between(xs, ys, color=colour, alpha=0.08, linewidth=0)
            top_value = max(top_value, *s.values)
        ax.set_xlim(start, end)
        ax.set_ylim(min(0.0, *(min(s.values) for s in p.series)), top_value * 1.12 or 1.0)
        ax.set_xticks(ticks)
        ax.xaxis.set_major_formatter(
            FuncFormatter(lambda v, _pos: time.strftime("%H:%M:%S", time.gmtime(v)))
        )
        unit = p.unit
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos, u=unit: _tick(u, v)))
        ax.legend(
            loc="upper left",
            bbox_to_anchor=(fx(left + 0.1), fy(top + h - legend_h - 0.04)),
            bbox_transform=fig.transFigure,
            ncol=ncol,
            frameon=False,
            fontsize=8,
            labelcolor=TEXT,
            handlelength=1.2,
            columnspacing=1.5,
            borderaxespad=0,
        )
    fig.savefig(out, dpi=DPI, facecolor=BG)


# -- the run ----------------------------------------------------------------------------------
def _run(args: argparse.Namespace, dashboard: dict[str, Any], log: Log) -> dict[str, Any]:
    """The run: processes, load, settling, queries. Its record, for ``render`` (and ``--json``)."""
    work = Path(tempfile.mkdtemp(prefix="capyctl-dashboard-"))
    procs = ProcessSet(work)
    old = {s: signal.signal(s, _terminate) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    began = time.monotonic()
    keep = args.keep
    try:
        sv = _serve(procs, work, args.prometheus, log)
        start = time.time() - 10
        tally = _run_async(_drive(sv, args.load_s, args.seed, log))
        log(f"load done; {args.settle_s:g} s with none")
        time.sleep(args.settle_s + 2 * SCRAPE_S)
        end = time.time()
        answers = fetch(sv.prometheus_url, dashboard, start, end)
        info = httpx.get(f"{sv.prometheus_url}/api/v1/status/buildinfo", timeout=10).json()
    except StartupError:
        keep = True
        raise
    finally:
        procs.stop_all()
        for s, h in old.items():
            signal.signal(s, h)
        if keep:
            log(f"logs in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return {
        "load_s": args.load_s,
        "settle_s": args.settle_s,
        "seed": args.seed,
        "start": start,
        "end": end,
        "elapsed_s": round(time.monotonic() - began, 1),
        "prometheus": info["data"]["version"],
        "requests": {group: dict(counts.most_common()) for group, counts in tally.items()},
        "answers": answers,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ops.render_dashboard",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--load-s", type=float, default=180.0, help="the load's length")
    parser.add_argument("--settle-s", type=float, default=20.0, help="no load, after it")
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    parser.add_argument("--prometheus", default=shutil.which("prometheus"))
    parser.add_argument("--json", type=Path, default=None, help="write the run's record here")
    parser.add_argument(
        "--from-json", type=Path, default=None, help="draw a record --json wrote; run nothing"
    )
    parser.add_argument("--keep", action="store_true", help="keep the logs' directory")
    args = parser.parse_args(argv)

    def log(msg: str) -> None:
        print(f"render_dashboard: {msg}", file=sys.stderr, flush=True)

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error("matplotlib is not installed (.venv/bin/pip install matplotlib)")
    dashboard = json.loads(args.dashboard.read_text(encoding="utf-8"))
    if args.from_json is not None:
        record = json.loads(args.from_json.read_text(encoding="utf-8"))
    else:
        if not args.prometheus:
            parser.error("no prometheus on PATH (apt-get install prometheus) nor --prometheus")
        try:
            record = _run(args, dashboard, log)
        except StartupError as exc:
            log(str(exc))
            return 2
        if args.json is not None:
            args.json.write_text(json.dumps(record, indent=1), encoding="utf-8")
    for group, counts in record["requests"].items():
        listed = ", ".join(f"{k} {v:,}" for k, v in counts.items())
        log(f"{group}: {sum(counts.values()):,} requests: {listed}")
    panels = panels_from(dashboard, record["answers"])
    for p in panels:
        err = f"; errors: {p.errors}" if p.errors else ""
        log(f"panel {p.title!r}: {len(p.series)} series{err}")
    total = sum(sum(c.values()) for c in record["requests"].values())
    start, end = record["start"], record["end"]
    subtitle = (
        f"A real run, drawn without Grafana: {record['load_s']:g} s of mixed load ({total:,} "
        f"requests) through capyctl-gateway, then {record['settle_s']:g} s of none, scraped "
        f"every {SCRAPE_S:g} s by Prometheus {record.get('prometheus', '')}.\n"
        f"Each panel is Prometheus's answer to the panel's own queries (step {STEP_S:g} s, "
        f"$__rate_interval = {RATE_INTERVAL}, deployment = All). "
        f"Times in UTC, {time.strftime('%Y-%m-%d', time.gmtime(start))}."
    )
    render(panels, args.out, title=dashboard["title"], subtitle=subtitle, start=start, end=end)
    took = f" after a run of {record['elapsed_s']:g} s" if args.from_json is None else ""
    log(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB){took}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
