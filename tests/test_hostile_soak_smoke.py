"""The soak under its adversaries (bench/perf/hostile_soak.py) runs end to end, quick: steady
requests through two workers beside slow bodies, heavy bodies, big bodies and a frozen worker;
its own rules hold (nothing lost, heavy 413, big 200, the frozen worker replaced)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the soak reads /proc")
def test_quick_hostile_soak_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "hostile.json"
    argv = [sys.executable, "-m", "bench.perf.hostile_soak", "--quick", "--json", str(out)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=120, check=False)
    assert proc.returncode == 0, (proc.stdout.decode()[-3000:], proc.stderr.decode()[-3000:])
    doc = json.loads(out.read_bytes())
    assert doc["problems"] == []
    steady = doc["steady"]["outcomes"]
    assert steady.get("served", 0) > 100 and not steady.get("lost")
    assert doc["heavy"].get("413", 0) >= 4 and doc["big"].get("200", 0) >= 1
    assert doc["frozen_worker_replaced_after_s"] is not None
    assert doc["slow_bodies_opened"] >= 16
