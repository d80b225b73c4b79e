"""Every panel of the Grafana dashboard in docs/ops/ has data in a real run: Prometheus (Debian's
package) scraping a capyctl-gateway that runs a real llama-server, under a short load of
streamed and non-streamed requests with hang-ups and refusals; each panel's query sent as
Grafana would send it (``bench.ops.realrun``, shared with ``python -m bench.ops.render_dashboard``,
which draws a longer run into docs/ops/dashboard.png)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest
from bench.ops import realrun
from bench.perf._procs import ProcessSet

SCRAPE_S = 1.0
STEP_S = 1.0
NO_DATA_EXPECTED: dict[str, str] = {}
"""Panel targets (their ``expr``) that cannot have data in this short run, with the reason.
Empty: every panel has data."""


def _prometheus() -> str:
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(
                "prometheus is not installed (scripts/system-packages installs Debian's package)"
            )
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    return found


@pytest.mark.timeout(120)
def test_every_panel_of_the_dashboard_has_data_in_a_real_run(
    tmp_path: Path, llama_server_binary: Path, llama_models: Path
) -> None:
    prometheus = _prometheus()
    dashboard = realrun.load_dashboard()
    procs = ProcessSet(tmp_path)
    try:
        stack = realrun.Stack.start(
            procs,
            tmp_path,
            prometheus=prometheus,
            binary=llama_server_binary,
            model=llama_models / "tiny.gguf",
            scrape_s=SCRAPE_S,
        )
        start = time.time()
        load = realrun.Load(requests=150, duration_s=12.0, concurrency=4)
        tally = asyncio.run(realrun.drive(stack.gateway_url, stack.key, load))
        # The last scrapes see the load's end.
        time.sleep(3 * SCRAPE_S)
        end = time.time()
        assert tally["hung up mid-stream"] > 0 and tally["HTTP 200 streamed"] > 0, tally
        assert tally["HTTP 200"] > 0, tally
        assert (
            realrun.DEPLOYMENT
            in realrun.label_values(stack.prometheus_url, dashboard)["deployment"]
        )
        empty = []
        for chosen in ("$__all", realrun.DEPLOYMENT):
            values = realrun.variables(
                dashboard,
                step_s=STEP_S,
                scrape_s=SCRAPE_S,
                range_s=end - start,
                deployment=chosen,
            )
            answers = realrun.evaluate(
                stack.prometheus_url,
                dashboard,
                start=start,
                end=end,
                step_s=STEP_S,
                values=values,
            )
            assert len(answers) >= 20
            empty += [
                f"{a.panel}: {a.query}: {a.why_empty()}"
                for a in answers
                if not a.has_data and a.expr not in NO_DATA_EXPECTED
            ]
        assert not empty, "\n".join(empty)
    finally:
        procs.stop_all()
