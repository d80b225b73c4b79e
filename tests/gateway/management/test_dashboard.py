"""The Grafana dashboard in docs/ops/ asks only for series the gateway exposes, with labels
they carry: checked against a real scrape after real traffic."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import Gw
from tests.gateway.fake_engine import FakeEngine, vllm_stream
from tests.gateway.management.test_metrics import scrape

pytestmark = pytest.mark.anyio
DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "ops" / "capyctl-gateway.grafana.json"
_SERIES = re.compile(r"\bcapyctl_[a-z_]+\b")
_BY = re.compile(r"\bby \(([^)]*)\)")


def expressions() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in doc["panels"] for t in p["targets"]]


async def test_every_panel_reads_series_the_gateway_exposes(
    gateway: Gw, engine: FakeEngine
) -> None:
    engine.script = vllm_stream()
    async with gateway.client() as c:
        for body in (
            {"model": "my-model", "messages": [{"role": "user", "content": "hi"}]},
            {"model": "nope", "messages": []},
        ):
            await c.post("/v1/chat/completions", json=body)
    labels: dict[str, set[str]] = {}
    families: set[str] = set()
    for family in text_string_to_metric_families((await scrape(gateway)).text):
        families.add(family.name)  # present even while it has no sample yet
        for s in family.samples:
            labels.setdefault(s.name, set()).update(s.labels)
    exprs = expressions()
    assert len(exprs) >= 12
    # Series the configuration here has no instance of (launched deployments, a budget).
    optional = {"capyctl_lifecycle_state", "capyctl_memory_budget_bytes"}
    for expr in exprs:
        for name in _SERIES.findall(expr):
            if name in optional:
                continue
            base = re.sub(r"_(total|bucket|sum|count)$", "", name)
            assert name in labels or base in families, f"{name} (in {expr!r}) is not exposed"
            if name not in labels:
                continue  # no sample in this run: its labels cannot be checked
            for group in _BY.findall(expr):
                for label in filter(None, (x.strip() for x in group.split(","))):
                    assert label in labels[name] | {"le"}, f"{name} has no label {label}"
