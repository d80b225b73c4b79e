"""The soak (bench/perf/soak.py) runs end to end: a short smoke run, no speed or memory asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bench.perf._procfs import running, session_pids

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the soak reads /proc")
def test_quick_soak_serves_everything_samples_and_stops_what_it_started(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    argv = [sys.executable, "-m", "bench.perf.soak", "--quick", "--json", str(out)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]

    doc = json.loads(out.read_bytes())
    streams = doc["streams"]
    assert streams["served"] == streams["streams"] == 100, streams["first_errors"]
    assert streams["all_open_together"]
    assert streams["rss_mib"]["before"] and streams["rss_mib"]["peak"]
    assert streams["fds"]["peak"] > streams["fds"]["before"]
    assert streams["samples"]

    row = doc["in_a_row"]
    assert row["completed"] == row["requests"] == 2000, row["first_error"]
    assert row["failed"] == 0 and row["wrong_chunk_counts"] == 0
    assert [s["requests"] for s in row["samples"]] == [500, 1000, 1500, 2000]
    assert all(s["rss_mib"] and s["fds"] for s in row["samples"])

    report = proc.stdout.decode()
    assert "| 100 concurrent slow streams" in report
    assert "| 2,000 requests in a row" in report

    for started in doc["meta"]["processes"].values():
        assert set(started) == {"engine", "gateway"}
        for pid in started.values():
            assert not running(pid)
            assert not [p for p in session_pids(pid) if running(p)]
