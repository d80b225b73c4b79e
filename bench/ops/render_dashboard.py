"""Draw the Grafana dashboard of docs/ops/ from a real run, without Grafana.

Grafana cannot be used here (no package installs it), so this script does what Grafana would do
with the dashboard's JSON, against real processes on loopback (``bench.ops.realrun``, shared
with the live test ``contract/live/test_dashboard_live.py``):

1. starts a ``capyctl-gateway`` (``serve --metrics``) with one deployment, ``my-model``, whose
   ``llama-server`` (the cached build 10798, a tiny random model generated on the spot) the
   gateway starts on the first request and stops after 15 s idle, under a memory budget; 2
   running slots and 6 places to wait;
2. starts a real Prometheus (a config it writes in a temporary directory, scraping the metrics
   listener every 2 s with the gateway's key read from a file);
3. drives a load in phases (``PHASES``): steady streamed and non-streamed requests, 4 at once,
   some hung up mid-stream; a burst of 16 at once, past the queue's room (429 ``queue_full``);
   a lull longer than the idle timeout (the gateway stops llama-server); the load again (the
   gateway starts it again); throughout the load a trickle of refusals (unknown model, wrong
   key, malformed body); then ``--settle-s`` with none;
4. sends every panel target's query to Prometheus' ``/api/v1/query_range`` (step 2 s, Grafana's
   variables as ``realrun.variables`` puts them, deployment "All"), prints a report (each
   target: its query, how many series, a value, or why it is empty), and draws the panels into
   one PNG laid out by their ``gridPos``, titled as in the JSON, each series named by its
   ``legendFormat``. A panel whose queries return nothing says "No data".

Needs, beyond the project's venv: Prometheus on PATH or ``--prometheus PATH``
(``apt-get install prometheus``; 2.42 tested) and matplotlib (``.venv/bin/pip install --group
docs``, or ``pip install --target DIR matplotlib`` and ``PYTHONPATH=DIR``).

Run from the repository root: ``.venv/bin/python -m bench.ops.render_dashboard`` (about 2.5
minutes; writes docs/ops/dashboard.png, or ``--out FILE``). ``--json FILE`` keeps the run's
record (the requests' endings, every query and Prometheus' answer); ``--from-json FILE`` draws a
record again without running anything; ``--keep`` keeps the processes' logs (a process that
fails to start shows its log's tail anyway). Everything it started is stopped (by process
group) and its temporary directory removed, however it ends (Ctrl-C included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from ..perf._procs import ROOT, ProcessSet, StartupError, tidy
from . import realrun

__all__ = ["main"]

OUT = ROOT / "docs" / "ops" / "dashboard.png"
STEP_S = 2.0
SCRAPE_S = 2.0
IDLE_TIMEOUT_S = 15.0
Log = Callable[[str], None]

PHASES: tuple[tuple[str, realrun.Load | float], ...] = (
    ("steady", realrun.Load(requests=300, duration_s=60, concurrency=4, max_tokens=(64, 512))),
    ("burst", realrun.Load(requests=240, duration_s=8, concurrency=16, max_tokens=(256, 768))),
    ("steady", realrun.Load(requests=100, duration_s=20, concurrency=3, max_tokens=(64, 512))),
    ("lull", IDLE_TIMEOUT_S + 12),  # no request: llama-server is stopped when idle
    ("again", realrun.Load(requests=150, duration_s=30, concurrency=4, max_tokens=(64, 512))),
)
"""The load: a phase is a load or seconds without requests."""


# -- the run ----------------------------------------------------------------------------------
def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _run(args: argparse.Namespace, dashboard: dict[str, Any], log: Log) -> dict[str, Any]:
    """The run: processes, load, settling, queries. Its record, for ``render`` (and ``--json``)."""
    from contract.engines.llamacpp import ensure_llama_server
    from contract.engines.tiny_gguf import write_tiny_gguf

    work = Path(tempfile.mkdtemp(prefix="capyctl-dashboard-"))
    procs = ProcessSet(work)
    old = {s: signal.signal(s, _terminate) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    began = time.monotonic()
    tally: dict[str, Counter[str]] = {}
    try:
        binary = ensure_llama_server()
        model = write_tiny_gguf(work / "tiny.gguf", seed=0, context_length=8192)
        stack = realrun.Stack.start(
            procs,
            work,
            prometheus=args.prometheus,
            binary=binary,
            model=model,
            scrape_s=SCRAPE_S,
            idle_timeout_s=IDLE_TIMEOUT_S,
            max_running=2,
            max_waiting=6,
            log=log,
        )
        start = time.time() - 4
        for i, (name, phase) in enumerate(PHASES):
            t0 = time.monotonic()
            if isinstance(phase, float):
                log(f"{name}: {phase:g} s without requests")
                time.sleep(phase)
                continue
            got = asyncio.run(realrun.drive(stack.gateway_url, stack.key, phase))
            tally.setdefault(name, Counter()).update(got)
            took = time.monotonic() - t0
            log(f"{name}: {sum(got.values())} requests in {took:.0f} s: {_counts(got)}")
            if i == 0 and got["HTTP 200"] + got["HTTP 200 streamed"] == 0:
                raise StartupError(f"nothing was served: {_counts(got)}")
        log(f"load done; {args.settle_s:g} s with none")
        time.sleep(args.settle_s + SCRAPE_S)
        end = time.time()
        values = realrun.variables(
            dashboard, step_s=STEP_S, scrape_s=SCRAPE_S, range_s=end - start, deployment="$__all"
        )
        answers = realrun.evaluate(
            stack.prometheus_url, dashboard, start=start, end=end, step_s=STEP_S, values=values
        )
        listed = realrun.label_values(stack.prometheus_url, dashboard)
    finally:
        procs.stop_all()
        tidy(old, work, keep=args.keep, log=log)
    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime(start)),
        "start": start,
        "end": end,
        "elapsed_s": round(time.monotonic() - began, 1),
        "prometheus": stack.prometheus_version,
        "variables": values,
        "label_values": listed,
        "requests": {name: dict(c.most_common()) for name, c in tally.items()},
        "answers": [
            {
                "panel": a.panel,
                "expr": a.expr,
                "legend": a.legend,
                "query": a.query,
                "answer": a.doc,
            }
            for a in answers
        ],
    }


def _counts(c: Counter[str]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in c.most_common())


# -- the panels -------------------------------------------------------------------------------
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


def _legend(fmt: str, metric: dict[str, str]) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt)
    return " ".join(text.split()) or json.dumps(metric)


def panels_from(dashboard: dict[str, Any], answers: list[realrun.Answer]) -> list[PanelData]:
    """The dashboard's panels with their series, from ``realrun.evaluate``'s answers."""
    panels: list[PanelData] = []
    it = iter(answers)
    for p in dashboard["panels"]:
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        data = PanelData(p["title"], unit, p["gridPos"], [], [])
        for t in p.get("targets", []):
            a = next(it)
            if a.panel != p["title"] or a.expr != t["expr"]:
                raise ValueError(f"the answers do not match the dashboard at {p['title']!r}")
            if a.error is not None:
                data.errors.append(f"{a.query}: {a.error}")
            for metric, points in a.finite():
                if points:
                    times, values = (list(x) for x in zip(*points, strict=True))
                    data.series.append(Series(_legend(a.legend, metric), times, values))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ops.render_dashboard",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--settle-s", type=float, default=12.0, help="no load, after it")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--dashboard", type=Path, default=realrun.DASHBOARD)
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
        parser.error("matplotlib is not installed (.venv/bin/pip install --group docs)")
    dashboard = realrun.load_dashboard(args.dashboard)
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
    answers = [
        realrun.Answer(a["panel"], a["expr"], a["legend"], a["query"], a["answer"])
        for a in record["answers"]
    ]
    total = sum(sum(c.values()) for c in record["requests"].values())
    print(f"# A real run, {record['date']}: {total:,} requests\n")
    for name, counts in record["requests"].items():
        print(f"- {name}: {_counts(Counter(counts))}")
    print(f"\n$deployment lists: {record['label_values']}; variables: {record['variables']}\n")
    print(realrun.report(answers))
    empty = [a for a in answers if not a.has_data]
    start, end = record["start"], record["end"]
    subtitle = (
        f"A real run, drawn without Grafana: capyctl-gateway running llama-server (tiny model), "
        f"{total:,} requests in phases (steady, a burst past the queue, a lull that stops "
        f"the engine, again), scraped every {SCRAPE_S:g} s by Prometheus {record['prometheus']}.\n"
        f"Each panel is Prometheus' answer to the panel's own queries (step {STEP_S:g} s, "
        f"$__rate_interval = {record['variables']['__rate_interval']}, deployment = All). "
        f"Times in UTC, {record['date']}."
    )
    panels = panels_from(dashboard, answers)
    render(panels, args.out, title=dashboard["title"], subtitle=subtitle, start=start, end=end)
    took = f" after a run of {record['elapsed_s']:g} s" if args.from_json is None else ""
    log(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB){took}")
    if empty:
        log(f"{len(empty)} of {len(answers)} panel targets have no data")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
