"""The fault soak (bench/perf/faults.py) runs end to end: a quick run with a random seed (it is in
the report when something fails), no timing asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bench.perf._procfs import running, session_pids
from bench.perf.fault_engine import MODES
from bench.perf.faults import COMBOS, PHASES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the soak reads /proc")
def test_quick_fault_soak_loses_nothing_and_leaves_no_engine_connection_open(
    tmp_path: Path,
) -> None:
    out = tmp_path / "faults.json"
    argv = [sys.executable, "-m", "bench.perf.faults", "--quick", "--json", str(out)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=90, check=False)
    report = proc.stdout.decode()
    assert proc.returncode == 0, report[-6000:] + proc.stderr.decode()[-3000:]

    doc = json.loads(out.read_bytes())
    run = doc["run"]
    assert run["requests"] == 200
    assert run["lost"] == 0, run["lost_examples"]
    assert run["by_category"]["lost"] == 0
    assert sum(run["by_category"].values()) == 200
    engine = run["engine"]
    assert engine["open_chat_connections"] == 0
    assert engine["in_progress"] == 0
    assert engine["left_open_ids"] == [] and engine["not_closed_ids"] == []
    assert engine["counts_add_up"] and engine["duplicates"] == 0
    assert run["failures"] == []

    # Every kind of plan occurred: each hang-up phase, engine mode, streamed and not.
    assert set(run["by_kind"]) == {f"{p}/{m}/{'stream' if s else 'json'}" for p, m, s in COMBOS}
    assert set(run["by_phase"]) == set(PHASES)
    assert set(run["by_mode"]) == set(MODES)
    assert all(engine["by_mode"][m] > 0 for m in MODES)

    # The gateway's own account was read, before and after.
    gw = run["gateway"]
    assert gw["before"]["rss_mib"] and gw["after_idle"]["rss_mib"]
    assert gw["before"]["fds"] and gw["after_idle"]["fds"]
    assert run["status"]["after_idle"]["available"]
    assert run["status"]["after_idle"]["router_running"] == 0

    assert "## Fault soak (capyctl-gateway)" in report
    assert "| lost requests | 0 | ok |" in report

    started = doc["meta"]["processes"]
    assert set(started) == {"engine", "gateway"}
    for pid in started.values():
        assert not running(pid)
        assert not [p for p in session_pids(pid) if running(p)]
