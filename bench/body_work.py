"""What one large body of small JSON values costs the gateway (issue 34, item 7): a chat body of
``--messages`` tiny messages (60 MiB for 2 million) sent while a small request is sent every
10 ms; reported: the body's answer, the slowest small request's time (the event loop's stall)
and the gateway process's peak RSS before and after.

The gateway runs as ``capyctl-gateway serve`` in its own process (its RSS its own) in front of
the repository's fake engine. Run: .venv/bin/python -m bench.body_work [--messages 2000000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from contract.engines._proc import free_port

ROOT = Path(__file__).resolve().parents[1]


def spawn(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.DEVNULL)


def rss_peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--messages", type=int, default=2_000_000)
    args = p.parse_args(argv)
    tiny = '{"role":"user","content":"a"}'
    body = ('{"model":"m","messages":[' + ",".join([tiny] * args.messages) + "]}").encode()
    engine_port, port, mport = free_port(), free_port(), free_port()
    engine = spawn([sys.executable, "-m", "tests.gateway.launchable_engine", "--served", "tiny",
                    "--port", str(engine_port)])  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "gateway.yaml"
        config.write_text(json.dumps({"deployments": [{
            "name": "m", "engine": "vllm", "engine_version": "0.31.0", "served_model": "tiny",
            "instances": [{"url": f"http://127.0.0.1:{engine_port}"}]}]}))  # fmt: skip
        env = {**os.environ, "CAPYCTL_STATE_DIR": tmp}
        gw = spawn([sys.executable, "-m", "capyctl_gateway.cli", "serve", "--config", str(config),
                    "--listen", f"127.0.0.1:{port}", "--management", f"127.0.0.1:{mport}"],
                   env)  # fmt: skip
        try:
            key = ""
            for _ in range(300):
                f = Path(tmp) / "identity" / "credentials"
                if f.exists() and f.read_text().strip():
                    key = f.read_text().split("api_key: ")[1].strip()
                    break
                await asyncio.sleep(0.05)
            url = f"http://127.0.0.1:{port}"
            headers = {"Authorization": f"Bearer {key}"}
            small = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as c:
                for _ in range(300):
                    try:
                        if (await c.post("/v1/chat/completions", json=small)).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await asyncio.sleep(0.05)
                before = rss_peak_mb(gw.pid)
                worst, done = 0.0, False

                async def probe() -> None:
                    nonlocal worst
                    while not done:
                        began = time.perf_counter()
                        await c.post("/v1/chat/completions", json=small)
                        worst = max(worst, time.perf_counter() - began)
                        await asyncio.sleep(0.01)

                prober = asyncio.create_task(probe())
                began = time.perf_counter()
                r = await c.post("/v1/chat/completions", content=body)
                took = time.perf_counter() - began
                await asyncio.sleep(0.5)
                done = True
                await prober
            report = {
                "body_mib": round(len(body) / 2**20, 1),
                "messages": args.messages,
                "answer": f"{r.status_code} {r.json().get('code', '')}".strip(),
                "answer_s": round(took, 3),
                "slowest_small_request_s": round(worst, 3),
                "rss_peak_mb_before": round(before, 1),
                "rss_peak_mb_after": round(rss_peak_mb(gw.pid), 1),
            }
            print(json.dumps(report))
        finally:
            gw.terminate()
            engine.terminate()
            gw.wait()
            engine.wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
