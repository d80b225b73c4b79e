"""The benchmark harness (bench/perf) runs end to end: a short smoke run, no speed asserted."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bench.perf._procfs import running, session_pids

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("ns", "s16", "s256", "ttft")
TARGETS = ("direct", "gateway")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the harness reads /proc")
def test_quick_run_measures_every_scenario_and_stops_what_it_started(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "bench.perf.run", "--quick", "--no-peer", "--json", str(out)]
    if shutil.which("wrk") is None:
        argv.append("--no-wrk")  # the SSE client then sends the non-streamed load too
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=50, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]

    doc = json.loads(out.read_bytes())
    (measured,) = doc["rounds"]
    for scenario in SCENARIOS:
        for target in TARGETS:
            m = measured[scenario][target]
            assert m["completed"] > 0, (scenario, target, m)
            assert m["failed"] == 0, (scenario, target, m)
    for scenario, chunks in (("s16", 16), ("s256", 256)):
        m = measured[scenario]["gateway"]
        assert m["content_chunks"] == chunks * m["completed"]
        assert m["cpu_s"] is not None
    assert [row["scenario"] for row in doc["summary"]["budget"]] == [
        "non-streamed, 32 conc.",
        "16-chunk streams, 32 conc.",
        "256-chunk streams, 32 conc.",
        "added TTFT, conc. 1",
    ]
    report = proc.stdout.decode()
    assert "| capyctl-gateway |" in report
    assert "| direct to the engine |" in report

    started = doc["meta"]["processes"]
    assert set(started) == {"engine", "gateway"}
    for pid in started.values():
        assert not running(pid)
        assert not [p for p in session_pids(pid) if running(p)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the harness reads /proc")
def test_the_aiohttp_floor_measures_both_sides() -> None:
    argv = [sys.executable, "-m", "bench.perf.aiohttp_floor", "--duration", "0.3"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    rows = [line for line in proc.stdout.decode().splitlines() if line.startswith("| client")]
    rows += [line for line in proc.stdout.decode().splitlines() if line.startswith("| server")]
    assert len(rows) == 5, proc.stdout.decode()
    for row in rows:
        assert float(row.rstrip(" |").rsplit("|", 1)[1]) > 0, row


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the harness reads /proc")
@pytest.mark.parametrize("other", ["responses", "messages"])
def test_another_api_beside_chat_measures_both_apis_and_stops_what_it_started(
    tmp_path: Path, other: str
) -> None:
    """``responses_e2e`` and ``messages_e2e``: one round of each API beside chat."""
    out = tmp_path / f"{other}.json"
    argv = [
        sys.executable,
        "-m",
        f"bench.perf.{other}_e2e",
        "--rounds",
        "1",
        "--duration",
        "0.5",
        "--warmup",
        "0.2",
        "--json",
        str(out),
    ]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]

    doc = json.loads(out.read_bytes())
    (measured,) = doc["rounds"]
    for scenario, chunks in (("ns", None), ("s16", 16), ("s256", 256)):
        for api in ("chat", other):
            m = measured[scenario][api]
            assert m["completed"] > 0 and m["failed"] == 0, (scenario, api, m)
            assert m["cpu_s"] is not None and m["cpu_s"] > 0
            if chunks is not None:  # every text event read, on either API
                assert m["content_chunks"] == chunks * m["completed"], (scenario, api, m)
    table = [ln for ln in proc.stdout.decode().splitlines() if ln.startswith("| s")]
    assert len(table) == 2 and "not measured" not in "".join(table), proc.stdout.decode()
    for pid in doc["meta"]["processes"].values():
        assert not running(pid)
        assert not [p for p in session_pids(pid) if running(p)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the harness reads /proc")
@pytest.mark.timeout(150)
def test_the_contention_benchmark_runs_each_policy_and_scenario_and_stops_its_engines(
    tmp_path: Path,
) -> None:
    """``bench.contention --quick``: the three policies on (i), ``cost_aware`` on (ii) and
    (iii), each through a gateway that launches the fake engines and switches them."""
    out = tmp_path / "contention.json"
    argv = [sys.executable, "-m", "bench.contention", "--quick", "--out", str(out)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=140, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]

    doc = json.loads(out.read_bytes())
    runs = {(r["scenario"], r["policy"]): r for r in doc["runs"]}
    assert set(runs) == {
        ("i", "on_arrival"),
        ("i", "collate"),
        ("i", "cost_aware"),
        ("ii", "cost_aware"),
        ("iii", "cost_aware"),
    }
    reasons = {"on_arrival": {"on_arrival"}, "collate": {"collate"}}
    for (scenario, policy), r in runs.items():
        assert r["answered"] > 0 and r["lost"] == 0, (scenario, policy, r["errors"])
        assert r["per_minute"] > 0 and r["listed"]["reads"] > 0
        assert set(r["switches"]) <= reasons.get(policy, {"idle", "waited", "fairness"}), r
        waits = [d["wait_max_s"] for d in r["deployments"].values() if d["answered"]]
        assert waits and all(w is not None for w in waits)
        if scenario == "i":  # two agents, room for one: each policy switched and started
            assert sum(r["switches"].values()) >= 1 and r["starts"] + r["wakes"] >= 1, r
            assert r["transition_s"], r
    goals = doc["goals"]["fake"]
    assert goals["nothing_lost"] and "i_met" in goals and "iii_met" in goals
    report = proc.stdout.decode()
    assert "**fake, (i) two closed-loop agents on two models, a budget for one**" in report
    assert report.count("| cost_aware |") == 3

    assert doc["meta"]["leftovers"] == []
    for r in doc["runs"]:
        assert not running(r["gateway_pid"])
