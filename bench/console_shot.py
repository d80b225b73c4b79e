"""The console's picture for the docs, from a real run: ``capyctl-gateway serve`` launching a real
llama-server (the cached build, a tiny model generated on the spot), a few requests through it,
then the page that ``capyctl-gateway console`` points at, opened in headless Chromium and saved
as ``docs/gateway/console.png`` (1280x900).

Run: .venv/bin/python -m bench.console_shot [--out FILE] (from the repository root; builds
llama-server on first use; needs Debian's ``chromium``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from contract.engines._proc import free_port
from contract.engines.llamacpp import ensure_llama_server
from contract.engines.tiny_gguf import write_tiny_gguf

from bench.browser import Browser, chromium

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).absolute().parent
OUT = ROOT / "docs" / "gateway" / "console.png"


def config(binary: Path, model: Path) -> str:
    def launch(extra: list[str]) -> str:
        command = [str(binary), "-m", str(model), "-a", "tiny", "-c", "4096", *extra]
        return json.dumps({"command": command, "startup_timeout": "2m"})

    return (
        "resources: {memory_budget: 8GiB}\n"
        "deployments:\n"
        "  - name: my-model\n"
        "    engine: llamacpp\n"
        "    engine_version: b10798\n"
        "    served_model: tiny\n"
        "    memory: {ready: 3GiB}\n"
        "    instances:\n"
        f"      - launch: {launch(['--parallel', '2', '-n', '24'])}\n"
        "  - name: night-batch\n"
        "    engine: llamacpp\n"
        "    engine_version: b10798\n"
        "    served_model: tiny\n"
        "    memory: {ready: 3GiB}\n"
        "    instances:\n"
        f"      - launch: {launch(['--parallel', '1', '-n', '24'])}\n"
    )


def traffic(base: str, key: str, n: int) -> None:
    """``n`` chat requests, every third streamed, and one stream hung up after its first
    chunk (a cut request)."""
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "my-model", "messages": [{"role": "user", "content": "Hello"}]}
    with httpx.Client(base_url=base, headers=headers, timeout=180) as c:
        for i in range(n):
            if i % 3 == 2:
                with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                    for _ in r.iter_lines():
                        pass
            else:
                c.post("/v1/chat/completions", json=body).raise_for_status()
        with c.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True, "max_tokens": 4000}
        ) as r:
            next(r.iter_lines())


async def shoot(url: str, base: str, key: str, out: Path) -> None:
    binary = chromium()
    if binary is None:
        raise SystemExit("chromium is not installed (apt-get install chromium)")
    browser = Browser(binary, width=1280, height=900)
    try:
        await browser.start()
        await browser.goto(url)
        await browser.until("document.querySelector('#eventstate')?.textContent === 'live'")
        # requests while the page is open, in bursts a slot apart: their events arrive live,
        # and the figures have a few slots to draw
        for n in (6, 12, 9):
            await asyncio.to_thread(traffic, base, key, n)
            await asyncio.sleep(10)
        await browser.until("document.querySelectorAll('#events li').length >= 6")
        await browser.click('[data-deployment="my-model"] button[data-log="0"]')
        await browser.until("!!document.querySelector('pre.log')")
        await asyncio.sleep(1)  # the log's lines drawn
        await browser.screenshot(out)
    finally:
        await browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.console_shot")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    binary = ensure_llama_server()
    work = Path(tempfile.mkdtemp(prefix="capyctl-console-shot-"))
    gateway: subprocess.Popen[bytes] | None = None
    try:
        model = write_tiny_gguf(work / "tiny.gguf", seed=0, context_length=4096)
        (work / "gateway.yaml").write_text(config(binary, model))
        port, mport, state = free_port(), free_port(), work / "state"
        manage = ["--state-dir", str(state), "--management", f"127.0.0.1:{mport}"]
        argv = [str(BIN / "capyctl-gateway"), "serve", "--config", str(work / "gateway.yaml")]
        argv += ["--listen", f"127.0.0.1:{port}", "--log-format", "json", *manage]
        with (work / "gateway.log").open("wb") as log:
            gateway = subprocess.Popen(argv, stdout=log, stderr=log)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(base + "/v1/models", timeout=1)
                break
            except httpx.TransportError:
                if gateway.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("capyctl-gateway did not start") from None
                time.sleep(0.05)
        key = (state / "identity" / "credentials").read_text().split()[1]
        traffic(base, key, 12)  # the first starts llama-server
        url = subprocess.run(
            [str(BIN / "capyctl-gateway"), "console", *manage],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        asyncio.run(shoot(url, base, key, args.out))
        print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
