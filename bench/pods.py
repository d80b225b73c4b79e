"""What running an engine as a Kubernetes pod costs, measured against the Kubernetes API fake
and its fake kubelet (``tests/kube/``), with a real llama-server (the tests' build and tiny
model) as the pod's command:

- **Start to first token**: a stopped deployment, one streamed request; the time from sending
  it to its first content, for the same llama-server launched by the gateway on this machine
  (``launch:``) and run as a pod (``launch:`` + ``pod:``). The fake kubelet probes every
  ``PROBE_S`` (the local runner asks ``/health`` every 0.1 s too), so the difference is the
  pod runner's own work (a create, the watch's events, its own health check) plus the fake's
  (scheduling, spawning), not a real kubelet's or image pull's.
- **API calls** per start and per stop, by verb, counted at the fake API server.
- **Watch reconnects**: the watch's connection cut ``--cuts`` times, each after it ran
  ``QUIET_S``; the time until a new watch is open again (its first backoff, 0.1-0.2 s,
  included), and the lists it took (a cut resumes from its resourceVersion: no list); then
  the same with each renewal answered 410 (a list each time).

Run: .venv/bin/python -m bench.pods [--cycles 10] [--cuts 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web
from contract.engines.llamacpp import ensure_llama_server
from contract.engines.tiny_gguf import write_tiny_gguf
from tests.kube.apiserver import FakeApiServer
from tests.kube.kubelet import FakeKubelet
from tests.kube.scheduler import FakeNode

from capyctl_gateway._config import GatewayConfig
from capyctl_gateway._http.app import GATEWAY_KEY, create_app
from capyctl_gateway._http.server import GatewayRunner

KEY = "bench-" + "k" * 40
PROBE_S = 0.1
TIME_SCALE = PROBE_S / 5  # the manifest's probes run every 5 s
QUIET_S = 1.1
"""How long a watch runs before the bench cuts it (past the watch's `QUICK_END_S`)."""


def deployment(binary: Path, model: Path, pod: bool, idle: str | None = None) -> dict[str, Any]:
    command = [str(binary), "-m", str(model), "-a", "tiny", "-c", "2048", "-t", "1"]
    instance: dict[str, Any] = {"launch": {"command": command, "startup_timeout": "120s"}}
    if pod:
        instance["pod"] = {"image": "ghcr.io/ggml-org/llama.cpp:server", "grace_period": 5}
    return {
        "name": "m",
        "engine": "llamacpp",
        "engine_version": "b10798",
        "served_model": "tiny",
        "lifecycle": {"ready_idle_timeout": idle} if idle else {},
        "instances": [instance],
    }


async def serve(config: dict[str, Any], env: dict[str, str]) -> tuple[GatewayRunner, str, Any]:
    app = create_app(GatewayConfig.model_validate(config), KEY, env=env)
    runner = GatewayRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}", app[GATEWAY_KEY]


async def first_token(url: str) -> float:
    body = {"model": "m", "stream": True, "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
    began = time.perf_counter()
    async with (
        httpx.AsyncClient(timeout=120) as c,
        c.stream("POST", url + "/v1/chat/completions", json=body,
                 headers={"Authorization": f"Bearer {KEY}"}) as r,
    ):  # fmt: skip
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {await r.aread()!r}")
        took = None
        async for line in r.aiter_lines():
            if took is None and '"content"' in line:
                took = time.perf_counter() - began
    if took is None:
        raise RuntimeError("no content")
    return took


def watches(api: FakeApiServer) -> int:
    return sum(1 for _, _, q in api.calls if q.get("watch", "").lower() in ("true", "1"))


def verbs(api: FakeApiServer, since: int) -> dict[str, int]:
    seen: Counter[str] = Counter()
    for method, path, query in api.calls[since:]:
        watch = query.get("watch", "").lower() in ("true", "1")
        seen[
            "watch" if watch else f"{method} {path.rsplit('/', 2)[-2]}/{path.rsplit('/', 1)[-1]}"
        ] += 1
    return dict(seen)


@contextlib.asynccontextmanager
async def served(dep: dict[str, Any]) -> AsyncIterator[tuple[FakeApiServer, str, Any]]:
    """A gateway serving ``dep`` with a fake cluster beside it: the API, its URL, the gateway."""
    with tempfile.TemporaryDirectory() as tmp:
        nodes = [FakeNode("node-1", allocatable={"cpu": "8", "memory": "16Gi"})]
        async with FakeApiServer() as api, FakeKubelet(api, nodes, time_scale=TIME_SCALE):
            env = {"KUBECONFIG": str(api.kubeconfig(Path(tmp) / "kubeconfig", "bench"))}
            config = {"kubernetes": {"namespace": "bench"}, "deployments": [dep]}
            runner, url, gateway = await serve(config, env)
            try:
                yield api, url, gateway
            finally:
                await runner.cleanup()


async def starts(binary: Path, model: Path, cycles: int, pod: bool) -> dict[str, Any]:
    async with served(deployment(binary, model, pod, idle="0.5s")) as (api, url, gateway):
        ttft, start_calls, stop_calls = [], [], []
        life = gateway.fleet.lifecycle.lives["m"]
        for _ in range(cycles):
            mark = len(api.calls)
            ttft.append(await first_token(url))
            start_calls.append(verbs(api, mark))
            mark = len(api.calls)
            while life.state != "stopped" or (pod and api.store.list_pods("bench")):  # noqa: ASYNC110
                await asyncio.sleep(0.01)  # the idle clock stops it: polled
            stop_calls.append(verbs(api, mark))
    return {
        "runner": "pod" if pod else "local",
        "ttft_s": [round(t, 4) for t in ttft],
        "ttft_median_s": round(statistics.median(ttft), 4),
        "api_calls_per_start": start_calls[-1] if pod else {},
        "api_calls_per_stop": stop_calls[-1] if pod else {},
    }


async def reconnects(binary: Path, model: Path, cuts: int, expire: bool) -> dict[str, Any]:
    async with served(deployment(binary, model, True)) as (api, url, _):
        back: list[float] = []
        await first_token(url)
        mark = len(api.calls)
        for _ in range(cuts):
            if expire:
                api.fail_next("GET", "/pods", 410)
            await asyncio.sleep(QUIET_S)  # a watch that ran a while: no backoff owed
            opened = watches(api) + (2 if expire else 1)  # with 410: a refused one first
            began = time.perf_counter()
            api.drop_watches()
            while watches(api) < opened or api.open_watches == 0:  # noqa: ASYNC110
                await asyncio.sleep(0.001)  # another party's state: polled
            back.append(time.perf_counter() - began)
        calls = verbs(api, mark)
        await first_token(url)  # it still serves
    return {
        "renewal": "410 then list" if expire else "resume",
        "cuts": cuts,
        "back_s_median": round(statistics.median(back), 4),
        "back_s_max": round(max(back), 4),
        "api_calls": calls,
    }


async def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--cuts", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    binary = ensure_llama_server()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny.gguf"
        write_tiny_gguf(model, seed=0, context_length=4096)
        report = {
            "probe_period_s": PROBE_S,
            "starts": [await starts(binary, model, args.cycles, pod) for pod in (False, True)],
            "reconnects": [await reconnects(binary, model, args.cuts, e) for e in (False, True)],
        }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
