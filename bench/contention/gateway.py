"""One capyctl-gateway process for one run (a policy, a scenario, an engine), and what the
benchmark reads of it: ``/metrics`` (``capyctl_switches_total{reason}``,
``capyctl_lifecycle_seconds_total{deployment,phase}``,
``capyctl_lifecycle_transitions_total{deployment,to}``) and the management API's deployments
list (per pool: what is resident, what waits and since when, the next switch meant)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.perf._procs import Proc, ProcessSet, free_port
from bench.perf.run import api_key

__all__ = ["Gateway", "Listed", "Sample", "by_label", "delta", "start"]

Sample = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""A metric sample's value by its name and sorted labels."""
READ: tuple[str, ...] = (
    "capyctl_switches_total",
    "capyctl_lifecycle_seconds_total",
    "capyctl_lifecycle_transitions_total",
)


@dataclass
class Listed:
    """What the deployments list showed, read every ``every`` seconds during a window."""

    reads: int = 0
    waited_s: dict[str, float] = field(default_factory=dict)
    """Deployment -> the longest wait its oldest request was shown with."""
    intents: Counter[str] = field(default_factory=Counter)
    """``out -> in`` -> how many reads showed that switch meant next."""

    def add(self, doc: dict[str, Any]) -> None:
        self.reads += 1
        for pool in doc.get("pools", []):
            for row in pool.get("waiting", []):
                name = row["name"]
                self.waited_s[name] = max(self.waited_s.get(name, 0.0), row["oldest_s"])
            nxt = pool.get("next_switch")
            if nxt:
                self.intents[f"{nxt['out']} -> {nxt['in']}"] += 1

    def row(self) -> dict[str, Any]:
        return {"reads": self.reads, "waited_s": self.waited_s, "intents": dict(self.intents)}


@dataclass
class Gateway:
    proc: Proc
    url: str
    management: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def metrics(self) -> Sample:
        r = httpx.get(f"{self.management}/metrics", headers=self.headers, timeout=10)
        r.raise_for_status()
        out: Sample = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                if s.name in READ:
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    async def listing(self, c: httpx.AsyncClient) -> dict[str, Any]:
        r = await c.get(f"{self.management}/management/v1/deployments", headers=self.headers)
        r.raise_for_status()
        doc: dict[str, Any] = r.json()
        return doc


def start(procs: ProcessSet, work: Path, config: dict[str, Any], name: str) -> Gateway:
    """capyctl-gateway serving ``config`` (written as JSON, which is YAML), ready."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / "gateway.yaml"
    path.write_text(json.dumps(config, indent=1), encoding="utf-8")
    state = work / "state"
    gport, mport = free_port(), free_port()
    gw_bin = Path(sys.executable).with_name("capyctl-gateway")
    argv = [str(gw_bin)] if gw_bin.exists() else [sys.executable, "-m", "capyctl_gateway.cli"]
    argv += ["serve", "--config", str(path), "--listen", f"127.0.0.1:{gport}"]
    argv += ["--management", f"127.0.0.1:{mport}", "--state-dir", str(state)]
    proc = procs.start(name, [*argv, "--log-format", "json"])
    creds = state / "identity" / "credentials"
    proc.wait_file(creds)
    key = api_key(creds)
    url = f"http://127.0.0.1:{gport}"
    proc.wait_http(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    return Gateway(proc, url, f"http://127.0.0.1:{mport}", key)


def delta(before: Sample, after: Sample) -> Sample:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def by_label(sample: Sample, name: str, label: str) -> dict[str, float]:
    """``name``'s values summed by one of its labels."""
    out: dict[str, float] = {}
    for (metric, labels), value in sample.items():
        if metric == name:
            key = dict(labels)[label]
            out[key] = out.get(key, 0.0) + value
    return out
