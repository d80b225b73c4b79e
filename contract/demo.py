"""``scripts/demo``: the project's main job on an embedded default.

Builds llama.cpp's server (once) and generates a tiny model on the spot, then starts
``capyctl-gateway`` with a deployment it runs itself: the first request starts llama-server,
and is answered; the demo prints how to use the endpoint and manage the deployment (``list``,
``stop``, ``start``, and the browser console), and serves until Ctrl-C, when the gateway stops the engine it started.

``scripts/demo provider`` instead starts llama-server directly, checks it with
``canopyx-provider check`` and runs ``canopyx-provider simulate`` against it while two
generations fill its slots, showing quotes rise and turn into declines.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
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

# This checkout's commands (not resolved: the venv's python is a symlink out of the venv).
BIN = Path(sys.executable).absolute().parent
DEFAULT_STATE = Path("~/.local/state/capyctl").expanduser()
STATE = Path(os.environ.get("CAPYCTL_STATE_DIR") or DEFAULT_STATE).expanduser().absolute()
PREDICT = 64
"""llama-server's own cap on an answer's tokens (``-n``). The demo's tiny model ends its answers
by itself (``write_tiny_gguf(ends_sentences=True)``: after its first full stop, 7.5 tokens on
average), so the guide's requests, which send no ``max_tokens``, end ``stop`` and its Responses
``completed``; the cap only bounds the rare long one."""


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


def program(name: str) -> str:
    """This checkout's command ``name`` as the user types it: by its name where PATH finds it
    (``scripts/setup`` links it into ``~/.local/bin``), else by its absolute path, which works
    from any directory."""
    found = shutil.which(name)
    if found is not None and Path(found).resolve() == (BIN / name).resolve():
        return name
    return str(BIN / name)


def new_shell_hint(name: str) -> str | None:
    """Where ``program`` had to spell out a path this shell's PATH lacks but a new shell's has
    (``scripts/setup``'s link and its line in the shell's startup files): say so."""
    if program(name) == name or os.environ.get("CANOPYX_NO_MODIFY_PATH") == "1":
        return None
    xdg = os.environ.get("XDG_BIN_HOME", "")
    bin_dir = Path(xdg) if xdg.startswith("/") else Path("~/.local/bin").expanduser()
    link = bin_dir / name
    if not link.is_symlink() or link.resolve() != (BIN / name).resolve():
        return None
    return f"(a new shell finds {name} by name: scripts/setup linked it into {bin_dir})"


def command_line(argv: list[str | Path]) -> str:
    """A command line to print, its arguments quoted for a shell."""
    return shlex.join(str(a) for a in argv)


def provider_demo(url: str, common: list[str]) -> None:
    args = ["simulate", *common, "--quotes", "16", "--rate", "4"]
    print(f"\n$ {command_line([program('canopyx-provider'), *args])}")
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
        subprocess.run([str(BIN / "canopyx-provider"), *args], check=True)
    finally:
        stop.set()


def refused(what: str, answer: httpx.Response) -> str:
    """One line for a gateway's refusal of ``what``: its status, code and message."""
    try:
        body = answer.json()
    except ValueError:
        body = {}
    error = body.get("error", body) if isinstance(body, dict) else {}
    code = error.get("code") if isinstance(error, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    said = f"{code}: {message}" if code and message else (message or answer.text[:200].strip())
    return f"the gateway refused {what} ({answer.status_code} {said})"


def start_if_stopped(management: str, auth: dict[str, str]) -> None:
    """Start ``my-model`` again where an operator's stop (the demo's own ``capyctl stop
    my-model`` in an earlier run: the gateway keeps it in its state directory) holds it, so that
    the demo serves what it says it serves."""
    listing = httpx.get(f"{management}/deployments", headers=auth, timeout=30)
    listing.raise_for_status()
    row = next(d for d in listing.json()["deployments"] if d["name"] == "my-model")
    if not str(row["state"]).startswith("stopped by an operator"):
        return
    print("my-model was stopped by an operator (capyctl stop my-model): the demo starts it again")
    started = httpx.post(f"{management}/deployments/my-model/start", headers=auth, timeout=180)
    if started.status_code != 200:
        raise SystemExit(f"scripts/demo: {refused('the start of my-model', started)}")


def demo_model(path: Path) -> Path:
    """The gateway demo's tiny model: it ends its answers by itself (see :data:`PREDICT`)."""
    return write_tiny_gguf(path, seed=0, context_length=65536, ends_sentences=True)


def demo_config(binary: Path, model: Path) -> str:
    """The demo's gateway configuration: one deployment, ``my-model``, whose llama-server the
    gateway runs itself (started by the first request, stopped after 10 idle minutes)."""
    command = [str(binary), "-m", str(model), "-a", "tiny", "-c", "65536", "--parallel", "2"]
    command += ["-n", str(PREDICT)]
    return (
        "deployments:\n"
        "  - name: my-model\n"
        "    engine: llamacpp\n"
        "    engine_version: b10798\n"
        "    served_model: tiny\n"
        "    lifecycle: {ready_idle_timeout: 10m}\n"
        "    instances:\n"
        f"      - launch: {{command: {json.dumps(command)}, startup_timeout: 2m}}\n"
    )


def gateway_demo(binary: Path, model: Path, workdir: Path, *, once: bool) -> None:
    """The product's shape: the gateway runs llama-server itself (`demo_config`)."""
    config = workdir / "gateway.yaml"
    config.write_text(demo_config(binary, model))
    port = 8443 if _port_free(8443) else free_port()
    mport = 7443 if _port_free(7443) else free_port()
    cmd = [str(BIN / "capyctl-gateway"), "serve", "--config", str(config)]
    cmd += ["--listen", f"127.0.0.1:{port}", "--management", f"127.0.0.1:{mport}"]
    cmd += ["--state-dir", str(STATE), "--log-format", "text"]
    gateway = subprocess.Popen(cmd)
    try:
        endpoint = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(endpoint + "/models", timeout=1)
                break
            except httpx.TransportError:
                if gateway.poll() is not None:
                    raise SystemExit("scripts/demo: capyctl-gateway did not start") from None
                if time.monotonic() > deadline:
                    raise SystemExit(
                        f"scripts/demo: capyctl-gateway did not answer on port {port} in 60 s"
                    ) from None
                time.sleep(0.05)
        creds = STATE / "identity" / "credentials"
        key = creds.read_text().split("api_key: ", 1)[1].split()[0]
        auth = {"Authorization": f"Bearer {key}"}
        start_if_stopped(f"http://127.0.0.1:{mport}/management/v1", auth)
        answer = httpx.post(
            endpoint + "/chat/completions",
            headers=auth,
            json={
                "model": "my-model",
                "messages": [{"role": "user", "content": "Hello"}],
            },
            timeout=180,  # the first request waits for llama-server to start
        )
        if answer.status_code != 200:
            raise SystemExit(f"scripts/demo: {refused('its first request', answer)}")
        reply = answer.json()
        print(
            "\nThe first request started llama-server (the gateway runs it: see the lifecycle "
            "lines above).\nIts answer (a tiny random model: gibberish is right):"
        )
        print("  ", repr(reply["choices"][0]["message"]["content"]))
        print("   capyctl.metrics:", reply["capyctl"]["metrics"])
        logs = sorted((STATE / "logs").glob("my-model-0.*.log"), key=lambda p: p.stat().st_mtime)
        if logs:  # the gateway writes the engine's output there (the last 4 runs are kept)
            print(f"   llama-server's log: {logs[-1]}")
        print(f"\ncapyctl-gateway serves the OpenAI chat API at {endpoint}")
        # `capyctl` is `capyctl-gateway` under the name the product guide uses.
        capyctl = program("capyctl")
        status: list[str | Path] = [capyctl, "status", "deployment", "my-model"]
        if mport != 7443:
            status += ["--management", f"127.0.0.1:{mport}"]
        if STATE != DEFAULT_STATE:
            status += ["--state-dir", STATE]
        print(f"its state: {command_line(status)}")
        manage: list[str | Path] = []
        if mport != 7443:
            manage += ["--management", f"127.0.0.1:{mport}"]
        if STATE != DEFAULT_STATE:
            manage += ["--state-dir", STATE]
        for verb in (["list"], ["stop", "my-model"], ["start", "my-model"]):
            print(f"           {command_line([capyctl, *verb, *manage])}")
        console = command_line([capyctl, "console", *manage])
        print(f"its page in a browser: {console}")
        print("           (prints the address to open: it works once, within 60 s)")
        if hint := new_shell_hint("capyctl"):
            print(hint)
        print(f"the API key is in {creds} (line 'api_key: ...')")
        print("The tiny model ends its answers by itself after a full stop (llama-server's -n")
        print(f'caps them at {PREDICT} tokens), so requests without max_tokens end "stop" and')
        print('Responses end "completed"; add "stream": true to stream the answer.\n')
        print(f"KEY=$(sed -n 's/^api_key: //p' {shlex.quote(str(creds))})")
        print(f'curl -s {endpoint}/chat/completions -H "Authorization: Bearer $KEY" \\')
        print("  -H 'Content-Type: application/json' \\")
        print('  -d \'{"model": "my-model", "messages": [{"role": "user", "content": "Hello"}]}\'')
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
    # Each line as it is printed, also into a file or a pipe (`| tee`): the instructions are
    # read while the demo serves, not at its end.
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
    binary = ensure_llama_server()  # shows the build's progress when it has to build
    workdir = Path(tempfile.mkdtemp(prefix="canopyx-demo-"))
    try:
        if args.mode == "gateway":
            model = demo_model(workdir / "tiny.gguf")
            gateway_demo(binary, model, workdir, once=args.once)
            return 0
        # The provider demo's generations fill the slots for seconds: a model that never ends.
        model = write_tiny_gguf(workdir / "tiny.gguf", seed=0, context_length=65536)
        with LlamaServer(binary, model, parallel=2, ctx=65536) as server:
            url = server.base_url
            print(f"llama-server b10798 serving 'tiny' at {url} (pid {server.pid})")
            print(f"its log: {server.log_path}\n")
            common = ["--engine", "llamacpp", "--base-url", url, "--model", "tiny"]
            print(f"$ {command_line([program('canopyx-provider'), 'check', *common])}")
            subprocess.run([str(BIN / "canopyx-provider"), "check", *common], check=True)
            provider_demo(url, common)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        print("stopped.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
