"""The Grafana dashboard of docs/ops/ against a real run: Prometheus scraping a
``capyctl-gateway`` that runs a real ``llama-server``, a real load, and every panel's query
evaluated through Prometheus' HTTP API as Grafana would send it.

Shared by ``python -m bench.ops.render_dashboard`` (a longer run, drawn) and the live test
``contract/live/test_dashboard_live.py`` (a short run, every panel must have data). Nothing here
needs matplotlib or pytest.

* ``Stack.start``: the gateway (``serve --metrics``, deployment ``DEPLOYMENT``, whose llama-server
  the gateway launches on the first request and stops when idle, under a memory budget) and
  Prometheus (a config it writes, scraping the metrics listener every ``scrape_s`` with the
  gateway's key from a file: the key is never on a command line nor in a log);
* ``drive``: a load of streamed and non-streamed chat requests, a few at once, some hung up
  mid-stream, and alongside it a trickle of refused ones (unknown model, wrong key, bad body);
* ``evaluate``: each panel target's ``expr`` with Grafana's variables substituted
  (``variables``), sent to ``/api/v1/query_range``; ``Answer.has_data`` says whether it has a
  finite point.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ..perf._procs import ROOT, Proc, ProcessSet, StartupError, free_port
from ..perf.run import api_key

__all__ = [
    "DASHBOARD",
    "DEPLOYMENT",
    "Answer",
    "Load",
    "Stack",
    "drive",
    "evaluate",
    "load_dashboard",
    "variables",
]

DASHBOARD = ROOT / "docs" / "ops" / "capyctl-gateway.grafana.json"
DEPLOYMENT = "my-model"
SERVED = "tiny"
Log = Callable[[str], None]


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return doc


# -- the processes ----------------------------------------------------------------------------
def gateway_config(
    binary: Path,
    model: Path,
    *,
    idle_timeout_s: float,
    max_running: int,
    max_waiting: int,
) -> str:
    """One launched llama.cpp deployment (2 slots), 1 GiB held of a 4 GiB budget."""
    command = [str(binary), "-m", str(model), "-a", SERVED, "-c", "8192"]
    command += ["--parallel", "2", "-t", "1"]
    return (
        "deployments:\n"
        f"  - name: {DEPLOYMENT}\n"
        "    engine: llamacpp\n"
        "    engine_version: b10798\n"
        f"    served_model: {SERVED}\n"
        "    memory: {ready: 1GiB}\n"
        f"    lifecycle: {{ready_idle_timeout: {idle_timeout_s:g}s}}\n"
        "    instances:\n"
        f"      - launch: {{command: {json.dumps(command)}, startup_timeout: 120s}}\n"
        "resources:\n"
        "  memory_budget: 4GiB\n"
        "queue:\n"
        f"  max_running_per_deployment: {max_running}\n"
        f"  max_waiting_per_deployment: {max_waiting}\n"
    )


@dataclass
class Stack:
    """The gateway and Prometheus, started in ``work`` by ``procs`` (which stops them)."""

    gateway_url: str
    key: str = field(repr=False)
    prometheus_url: str
    prometheus_version: str
    scrape_s: float

    @classmethod
    def start(
        cls,
        procs: ProcessSet,
        work: Path,
        *,
        prometheus: str,
        binary: Path,
        model: Path,
        scrape_s: float = 1.0,
        idle_timeout_s: float = 30.0,
        max_running: int = 4,
        max_waiting: int = 8,
        log: Log = lambda _msg: None,
    ) -> Stack:
        config = work / "gateway.yaml"
        config.write_text(
            gateway_config(
                binary,
                model,
                idle_timeout_s=idle_timeout_s,
                max_running=max_running,
                max_waiting=max_waiting,
            ),
            encoding="utf-8",
        )
        gport, mport, xport = free_port(), free_port(), free_port()
        gw_bin = Path(sys.executable).with_name("capyctl-gateway")
        argv = [str(gw_bin)] if gw_bin.exists() else [sys.executable, "-m", "capyctl_gateway.cli"]
        argv += ["serve", "--config", str(config), "--state-dir", str(work / "state")]
        argv += ["--listen", f"127.0.0.1:{gport}", "--management", f"127.0.0.1:{mport}"]
        argv += ["--metrics", f"127.0.0.1:{xport}", "--log-format", "json"]
        gateway = procs.start("gateway", argv)
        credentials = work / "state" / "identity" / "credentials"
        gateway.wait_file(credentials)
        key = api_key(credentials)
        url = f"http://127.0.0.1:{gport}"
        gateway.wait_http(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        log(f"gateway at {url}, its metrics listener at 127.0.0.1:{xport}")
        purl, version = _start_prometheus(
            procs, work, prometheus, f"127.0.0.1:{xport}", key, scrape_s
        )
        log(f"prometheus {version} at {purl}, scraping the gateway every {scrape_s:g} s")
        return cls(url, key, purl, version, scrape_s)


def _start_prometheus(
    procs: ProcessSet, work: Path, binary: str, target: str, key: str, scrape_s: float
) -> tuple[str, str]:
    home = work / "prometheus"
    home.mkdir()
    key_file = home / "key"
    key_file.touch(mode=0o600)
    key_file.write_text(key, encoding="utf-8")
    (home / "prometheus.yml").write_text(
        "global:\n"
        f"  scrape_interval: {scrape_s:g}s\n"
        f"  scrape_timeout: {scrape_s:g}s\n"
        "scrape_configs:\n"
        "  - job_name: capyctl-gateway\n"
        "    metrics_path: /metrics\n"
        # The gateway's own `instance` label (the instance's index) is what the panels mean;
        # without this Prometheus renames it `exported_instance` and puts its target there.
        "    honor_labels: true\n"
        "    authorization:\n"
        f"      credentials_file: {key_file}\n"
        "    static_configs:\n"
        f'      - targets: ["{target}"]\n',
        encoding="utf-8",
    )
    port = free_port()
    server = procs.start(
        "prometheus",
        [
            binary,
            f"--config.file={home / 'prometheus.yml'}",
            f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
    )
    url = f"http://127.0.0.1:{port}"
    server.wait_http(f"{url}/-/ready", timeout_s=60)
    _wait_scraped(server, url)
    info = httpx.get(f"{url}/api/v1/status/buildinfo", timeout=10).json()
    return url, str(info["data"]["version"])


def _wait_scraped(server: Proc, url: str, timeout_s: float = 30.0) -> None:
    """Until Prometheus has scraped the gateway once, successfully."""
    deadline = time.monotonic() + timeout_s
    while True:
        server.check_alive()
        targets = httpx.get(f"{url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        if targets and all(t["health"] == "up" for t in targets):
            return
        if time.monotonic() > deadline:
            raise StartupError(f"prometheus: the gateway's /metrics is not up: {targets}")
        time.sleep(0.2)


# -- the load ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    """``requests`` chat requests for the deployment, spread evenly over ``duration_s`` (so
    that the scrapes see them), at most ``concurrency`` at once; of them ``stream_share``
    streamed, and of those ``hang_up_share`` asking for a long answer and hung up after its
    first content; while it runs, one refused request every ``refuse_every_s``."""

    requests: int
    duration_s: float
    concurrency: int
    stream_share: float = 0.6
    hang_up_share: float = 0.15
    max_tokens: tuple[int, int] = (8, 64)
    hang_up_tokens: int = 2000
    refuse_every_s: float = 0.5
    seed: int = 25


async def drive(url: str, key: str, load: Load) -> Counter[str]:
    """Run ``load`` against the gateway at ``url``; how the requests ended, counted."""
    rng = random.Random(load.seed)
    tally: Counter[str] = Counter()
    issued = 0
    t0 = time.monotonic()
    gap = load.duration_s / max(1, load.requests)
    endpoint = f"{url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {key}"}
    done = asyncio.Event()

    async def one(client: httpx.AsyncClient) -> str:
        body: dict[str, Any] = {
            "model": DEPLOYMENT,
            "messages": [{"role": "user", "content": "Tell me about the dashboard."}],
            "max_tokens": rng.randint(*load.max_tokens),
        }
        if rng.random() >= load.stream_share:
            r = await client.post(endpoint, json=body, headers=auth)
            return f"HTTP {r.status_code}" + _code(r)
        body["stream"] = True
        hang_up = rng.random() < load.hang_up_share
        if hang_up:
            body["max_tokens"] = load.hang_up_tokens  # still generating when the client goes
        async with client.stream("POST", endpoint, json=body, headers=auth) as r:
            if r.status_code != 200:
                await r.aread()
                return f"HTTP {r.status_code}" + _code(r)
            async for line in r.aiter_lines():
                if hang_up and line.startswith("data: ") and '"content"' in line:
                    return "hung up mid-stream"  # leaving the block closes the connection
        return "HTTP 200 streamed"

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal issued
        while issued < load.requests:
            issued += 1
            await asyncio.sleep(max(0.0, t0 + (issued - 1) * gap - time.monotonic()))
            try:
                tally[await one(client)] += 1
            except httpx.HTTPError as exc:
                tally[type(exc).__name__] += 1

    async def refusals(client: httpx.AsyncClient) -> None:
        messages = [{"role": "user", "content": "hi"}]
        kinds: list[tuple[dict[str, Any], dict[str, str]]] = [
            ({"model": "no-such-model", "messages": messages}, auth),
            ({"model": DEPLOYMENT, "messages": messages}, {"Authorization": "Bearer wrong-key"}),
            ({"model": DEPLOYMENT, "messages": "not a list"}, auth),
        ]
        n = 0
        while not done.is_set():
            body, headers = kinds[n % len(kinds)]
            n += 1
            r = await client.post(endpoint, json=body, headers=headers)
            tally[f"refused: HTTP {r.status_code}" + _code(r)] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), load.refuse_every_s)

    limits = httpx.Limits(max_connections=load.concurrency + 2)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
        refusing = asyncio.create_task(refusals(client))
        try:
            await asyncio.gather(*(worker(client) for _ in range(load.concurrency)))
        finally:
            done.set()
            await refusing
    return tally


def _code(r: httpx.Response) -> str:
    try:
        code = r.json().get("code") if r.status_code != 200 else None
    except (ValueError, AttributeError):
        code = None
    return f" {code}" if code else ""


# -- the queries ------------------------------------------------------------------------------
_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")
_REGEX_SPECIAL = re.compile(r"([\\^$.|?*+()\[\]{}])")


def variables(
    dashboard: dict[str, Any], *, step_s: float, scrape_s: float, range_s: float, deployment: str
) -> dict[str, str]:
    """What Grafana puts for each variable a panel's query may use: ``$__interval`` is the
    step; ``$__rate_interval`` is max(interval + scrape interval, 4 x scrape interval), with the
    data source's scrape interval set to the real one; a template variable is ``deployment``
    (regex-escaped, as Grafana formats one value for Prometheus) or, for the value ``"$__all"``,
    its ``allValue``."""
    rate_s = max(step_s + scrape_s, 4 * scrape_s)
    found = {
        "__interval": f"{step_s:g}s",
        "__interval_ms": f"{step_s * 1000:g}",
        "__rate_interval": f"{rate_s:g}s",
        "__range": f"{range_s:.0f}s",
        "__range_s": f"{range_s:.0f}",
        "__range_ms": f"{range_s * 1000:.0f}",
    }
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "datasource":
            continue
        if deployment == "$__all":
            if not var.get("includeAll"):
                raise ValueError(f"variable {var['name']!r} has no All")
            found[var["name"]] = var.get("allValue") or ".*"
        else:
            found[var["name"]] = _REGEX_SPECIAL.sub(r"\\\1", deployment)
    return found


def substitute(expr: str, values: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = next(g for g in m.groups() if g)
        if name not in values:
            raise ValueError(f"{expr!r}: no value for the variable {name!r}")
        return values[name]

    return _VAR.sub(one, expr)


@dataclass
class Answer:
    """Prometheus' answer to one panel target."""

    panel: str
    expr: str
    """As in the dashboard."""
    legend: str
    query: str
    """As sent, variables substituted."""
    doc: dict[str, Any]

    @property
    def error(self) -> str | None:
        if self.doc.get("status") != "success":
            return str(self.doc.get("error") or self.doc)
        return None

    @property
    def result(self) -> list[dict[str, Any]]:
        if self.error is not None:
            return []
        result: list[dict[str, Any]] = self.doc["data"]["result"]
        return result

    def finite(self) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        """Each series with its finite points (a rate's quantile is NaN with nothing counted)."""
        out = []
        for res in self.result:
            points = [(float(t), float(v)) for t, v in res["values"]]
            out.append((res["metric"], [(t, v) for t, v in points if math.isfinite(v)]))
        return out

    @property
    def has_data(self) -> bool:
        return any(points for _, points in self.finite())

    def why_empty(self) -> str:
        if self.error is not None:
            return f"query error: {self.error}"
        if not self.result:
            return "no series"
        return f"{len(self.result)} series, every point NaN"

    def sample(self) -> str:
        """The last finite value of the series with the largest, for a report."""
        best: tuple[float, str] | None = None
        for metric, points in self.finite():
            if points:
                value = points[-1][1]
                label = ",".join(f"{k}={v}" for k, v in sorted(metric.items()) if k != "__name__")
                if best is None or abs(value) > abs(best[0]):
                    best = (value, label)
        return "" if best is None else f"{best[0]:.4g} ({{{best[1]}}})"


def evaluate(
    prometheus_url: str,
    dashboard: dict[str, Any],
    *,
    start: float,
    end: float,
    step_s: float,
    values: dict[str, str],
) -> list[Answer]:
    """Every panel target's query over [start, end], in the dashboard's order."""
    answers = []
    with httpx.Client(base_url=prometheus_url, timeout=30) as client:
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                query = substitute(target["expr"], values)
                params: dict[str, str | float] = {
                    "query": query,
                    "start": start,
                    "end": end,
                    "step": step_s,
                }
                doc = client.get("/api/v1/query_range", params=params).json()
                legend = target.get("legendFormat", "")
                answers.append(Answer(panel["title"], target["expr"], legend, query, doc))
    return answers


def label_values(prometheus_url: str, dashboard: dict[str, Any]) -> dict[str, list[str]]:
    """Each query variable's values, as Grafana lists them (``label_values(metric, label)``)."""
    found: dict[str, list[str]] = {}
    for var in dashboard.get("templating", {}).get("list", []):
        definition = var.get("definition") or ""
        m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", definition.strip())
        if var.get("type") != "query" or m is None:
            continue
        r = httpx.get(
            f"{prometheus_url}/api/v1/label/{m.group(2)}/values",
            params={"match[]": m.group(1)},
            timeout=10,
        )
        found[var["name"]] = list(r.json().get("data") or [])
    return found


def report(answers: list[Answer]) -> str:
    """A markdown table: each panel target, its query, series count, a sample or why empty."""
    lines = ["| panel | query | series | last value (largest series) |", "|---|---|---|---|"]
    for a in answers:
        got = a.sample() if a.has_data else f"**empty**: {a.why_empty()}"
        query = a.query.replace("|", "\\|")
        lines.append(f"| {a.panel} | `{query}` | {len(a.result)} | {got} |")
    return "\n".join(lines)
