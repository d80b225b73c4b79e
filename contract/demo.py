"""``scripts/demo``: canopyx-provider against a real local llama-server.

Builds (once) and starts llama.cpp's server with a tiny generated model, runs
``canopyx-provider check`` and then ``simulate`` while two long generations occupy both
slots for a while, so the quotes show the price rising and the declines, then stops the
server.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from contract.engines.llamacpp import LlamaServer, ensure_llama_server
from contract.engines.tiny_gguf import write_tiny_gguf


def _generate(base_url: str, *, after: float, seconds: float, stop: threading.Event) -> None:
    """One long streamed generation from ``after`` s for ``seconds`` s, then a hang-up."""
    if stop.wait(after):
        return
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 60000,
        "stream": True,
    }
    deadline = time.monotonic() + seconds
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", base_url + "/v1/chat/completions", json=body) as r,
    ):
        for _ in r.iter_lines():
            if stop.is_set() or time.monotonic() > deadline:
                return  # hang up: the server stops the generation


def main() -> int:
    cli = str(Path(sys.executable).with_name("canopyx-provider"))
    print("building or reusing llama-server (the first build takes several minutes)...")
    binary = ensure_llama_server()
    workdir = Path(tempfile.mkdtemp(prefix="canopyx-demo-"))
    try:
        model = write_tiny_gguf(workdir / "tiny.gguf", seed=0, context_length=65536)
        with LlamaServer(binary, model, parallel=2, ctx=65536) as server:
            url = server.base_url
            print(f"llama-server b10798 serving 'tiny' at {url} (pid {server.pid})\n")
            common = ["--engine", "llamacpp", "--base-url", url, "--model", "tiny"]
            print(f"$ canopyx-provider check {' '.join(common)}")
            subprocess.run([cli, "check", *common], check=True)
            print(f"\n$ canopyx-provider simulate {' '.join(common)} --quotes 16 --rate 4")
            print("(meanwhile one generation runs from 1 s to 3.5 s, a second from 2 s to 3.5 s)")
            stop = threading.Event()
            for after, seconds in ((1.0, 2.5), (2.0, 1.5)):
                threading.Thread(
                    target=_generate,
                    args=(url,),
                    kwargs={"after": after, "seconds": seconds, "stop": stop},
                    daemon=True,
                ).start()
            try:
                subprocess.run(
                    [cli, "simulate", *common, "--quotes", "16", "--rate", "4"], check=True
                )
            finally:
                stop.set()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("server stopped.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
