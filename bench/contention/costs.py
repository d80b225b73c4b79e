"""What a start, a stop and a wake of a real engine cost on this machine, at the pinned versions
(the contention benchmark's table of switch costs, ``docs/performance.md``):

- llama-server b10798 (the tests' build), the tests' tiny random GGUF at two sizes: from the
  process's launch to ``/health`` answering 200, then the first request's whole answer (8
  tokens), then from SIGTERM to its exit. A one-model llama-server has no park or wake.
- vLLM 0.31.0 CPU (the tests' install, ``--enforce-eager``, float32), the tests' tiny Llama:
  from the launch to ``/v1/models`` listing it (``VllmServer.startup_s``), its first request
  (``warmup_s``), its stop. With ``--sleep-mode`` also whether it starts with
  ``--enable-sleep-mode`` (the CPU build refuses it, so no wake can be measured here).

Run: .venv/bin/python -m bench.contention.costs [--repeats 3] [--vllm] [--sleep-mode]
[--out FILE]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.perf._procs import free_port

__all__ = ["main"]

SIZES = {"tiny (0.5 MB)": (64, 2, 128), "small (25 MB)": (256, 6, 1024)}


def _llama_once(binary: Path, model: Path) -> dict[str, float]:
    port = free_port()
    argv = [str(binary), "-m", str(model), "-a", "tiny", "-c", "4096", "--parallel", "2"]
    argv += ["-t", "1", "--host", "127.0.0.1", "--port", str(port), "--metrics"]
    began = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.005)  # polling a starting process
        ready = time.monotonic()
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
        answered = time.monotonic()
    finally:
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    return {
        "start_s": ready - began,
        "first_request_s": answered - ready,
        "stop_s": time.monotonic() - stopping,
    }


def _summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    return {
        k: {
            "median": round(statistics.median(r[k] for r in rows), 3),
            "min": round(min(r[k] for r in rows), 3),
            "max": round(max(r[k] for r in rows), 3),
        }
        for k in rows[0]
    }


def llamacpp(work: Path, repeats: int) -> dict[str, Any]:
    from contract.engines.llamacpp import ensure_llama_server
    from contract.engines.tiny_gguf import write_tiny_gguf

    binary = ensure_llama_server()
    out = {}
    for label, size in SIZES.items():
        model = write_tiny_gguf(work / f"{size[0]}.gguf", size=size)
        rows = [_llama_once(binary, model) for _ in range(repeats)]
        out[label] = {"bytes": model.stat().st_size, **_summary(rows)}
    return out


def vllm(repeats: int, sleep_mode: bool) -> dict[str, Any]:
    from contract.engines.tiny_hf_model import write_tiny_llama
    from contract.engines.vllm import VllmServer, engine_dir, ensure_vllm

    python = ensure_vllm()
    model = engine_dir() / "tiny-llama"
    write_tiny_llama(model, python=python)
    rows = []
    for _ in range(repeats):
        server = VllmServer(python, model, max_model_len=2048)
        server.start()
        stopping = time.monotonic()
        server.stop()
        stop = time.monotonic() - stopping
        rows.append(
            {"start_s": server.startup_s, "first_request_s": server.warmup_s, "stop_s": stop}
        )
    out: dict[str, Any] = {"tiny llama": _summary(rows)}
    if sleep_mode:
        server = VllmServer(
            python,
            model,
            max_model_len=2048,
            extra_args=["--enable-sleep-mode"],
            extra_env={"VLLM_SERVER_DEV_MODE": "1"},
            warmup=False,
        )
        try:
            server.start()
        except (RuntimeError, TimeoutError) as err:  # EngineExitedError: its refusal
            out["sleep_mode"] = f"refused: {str(err)[-600:]}"
        else:
            out["sleep_mode"] = "started"
            server.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vllm", action="store_true", help="also vLLM CPU (about a minute a start)")
    p.add_argument("--sleep-mode", action="store_true", help="try vLLM's sleep mode on CPU")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="engine-costs-") as work:
        doc: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "llama-server b10798": llamacpp(Path(work), args.repeats),
        }
    if args.vllm:
        doc["vLLM 0.31.0 CPU"] = vllm(args.repeats, args.sleep_mode)
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
