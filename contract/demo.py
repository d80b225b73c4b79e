"""``scripts/demo``: the project's main job on an embedded default.

Builds (once) and starts llama.cpp's server with a tiny model generated on the spot, checks it
with ``canopyx-provider check``, starts ``capyctl-gateway`` in front of it, proves the endpoint
with one real request, prints how to use it, and serves until Ctrl-C.

``scripts/demo provider`` instead runs ``canopyx-provider simulate`` against the engine while two
generations fill its slots, showing quotes rise and turn into declines.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from contract.engines._proc import free_port
from contract.engines.llamacpp import LlamaServer, ensure_llama_server
from contract.engines.tiny_gguf import write_tiny_gguf

BIN = Path(sys.executable).parent
STATE = Path(os.environ.get("CAPYCTL_STATE_DIR") or "~/.local/state/capyctl").expanduser()


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


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def provider_demo(url: str, common: list[str]) -> None:
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
            [str(BIN / "canopyx-provider"), "simulate", *common, "--quotes", "16", "--rate", "4"],
            check=True,
        )
    finally:
        stop.set()


def gateway_demo(url: str, workdir: Path, *, once: bool) -> None:
    config = workdir / "gateway.yaml"
    config.write_text(
        "deployments:\n"
        "  - name: my-model\n"
        "    engine: llamacpp\n"
        "    engine_version: b10798\n"
        "    served_model: tiny\n"
        "    instances:\n"
        f"      - url: {url}\n"
    )
    port = 8443 if _port_free(8443) else free_port()
    mport = 7443 if _port_free(7443) else free_port()
    cmd = [str(BIN / "capyctl-gateway"), "serve", "--config", str(config)]
    cmd += ["--listen", f"127.0.0.1:{port}", "--management", f"127.0.0.1:{mport}"]
    cmd += ["--state-dir", str(STATE), "--log-format", "text"]
    gateway = subprocess.Popen(cmd)
    try:
        endpoint = f"http://127.0.0.1:{port}/v1"
        for _ in range(200):
            try:
                httpx.get(endpoint + "/models", timeout=1)
                break
            except httpx.TransportError:
                if gateway.poll() is not None:
                    raise SystemExit("capyctl-gateway did not start") from None
                time.sleep(0.05)
        creds = STATE / "identity" / "credentials"
        key = creds.read_text().split("api_key: ", 1)[1].split()[0]
        reply = httpx.post(
            endpoint + "/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={
                "model": "my-model",
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 16,
            },
            timeout=30,
        ).json()
        print("\nA first answer through the gateway (a tiny random model: gibberish is right):")
        print("  ", repr(reply["choices"][0]["message"]["content"]))
        print("   capyctl.metrics:", reply["capyctl"]["metrics"])
        print(f"\ncapyctl-gateway serves the OpenAI chat API at {endpoint}")
        status = [os.path.relpath(BIN / "capyctl-gateway"), "status", "deployment", "my-model"]
        if mport != 7443:
            status += ["--management", f"127.0.0.1:{mport}"]
        print(f"its state: {' '.join(status)}")
        print(f"the API key is in {creds} (line 'api_key: ...')\n")
        print(f"KEY=$(sed -n 's/^api_key: //p' {creds})")
        print(f'curl -s {endpoint}/chat/completions -H "Authorization: Bearer $KEY" \\')
        print("  -H 'Content-Type: application/json' \\")
        print(
            '  -d \'{"model": "my-model", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}\''
        )
        if once:
            return
        print("\nServing until Ctrl-C.")
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while gateway.poll() is None and not stop.wait(0.5):
            pass
    finally:
        gateway.send_signal(signal.SIGINT)
        try:
            gateway.wait(10)
        except subprocess.TimeoutExpired:
            gateway.kill()


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/demo")
    parser.add_argument("mode", nargs="?", choices=("gateway", "provider"), default="gateway")
    parser.add_argument("--once", action="store_true", help="exit after the first answer")
    args = parser.parse_args()
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
            subprocess.run([str(BIN / "canopyx-provider"), "check", *common], check=True)
            if args.mode == "provider":
                provider_demo(url, common)
            else:
                gateway_demo(url, workdir, once=args.once)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("stopped.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
