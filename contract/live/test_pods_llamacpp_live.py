"""A real llama-server as a Kubernetes pod: the gateway's pod runner, through the real
`kubernetes_asyncio` client, against the Kubernetes API fake with its fake kubelet
(``tests/kube/``), which runs the pod's command (this machine's llama-server build) as a real
process on the pod's own loopback address and probes its ``/health`` as a kubelet does.

The first request starts the pod and is answered; the idle clock stops it (the pod deleted,
the process gone); a budget that holds one of two deployments switches between them, each
answer from its own model; a crash is restarted for the waiting request; the watch cut and
expired mid-way is listed again; a restarted gateway takes the running pod up."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from tests.eventually import eventually
from tests.kube.apiserver import FakeApiServer
from tests.kube.conftest import alive
from tests.kube.kubelet import FakeKubelet
from tests.kube.scheduler import FakeNode

from capyctl_gateway._config import GatewayConfig
from capyctl_gateway._http.app import GATEWAY_KEY, create_app
from capyctl_gateway._http.server import GatewayRunner
from capyctl_gateway._management.status import deployment_status
from capyctl_gateway._pods.manifest import NAME
from contract.conftest import RunningGateway
from contract.live.test_lifecycle_llamacpp_live import ask

pytestmark = pytest.mark.anyio
NS = "engines"
KEY = "live-" + "k" * 40


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Kube:
    def __init__(self, api: FakeApiServer, kubelet: FakeKubelet, kubeconfig: Path) -> None:
        self.api, self.kubelet, self.kubeconfig = api, kubelet, kubeconfig

    def pods(self, name: str | None = None) -> list[dict[str, Any]]:
        found = self.api.store.list_pods(NS)
        return [p for p in found if name is None or p["metadata"]["annotations"][NAME] == name]


@pytest.fixture
async def kube(tmp_path: Path) -> AsyncIterator[Kube]:
    nodes = [FakeNode("cpu-1", allocatable={"cpu": "8", "memory": "16Gi"})]
    async with FakeApiServer() as api, FakeKubelet(api, nodes, time_scale=0.05) as kubelet:
        yield Kube(api, kubelet, api.kubeconfig(tmp_path / "kubeconfig", NS))


def pod_deployment(name: str, binary: Path, model: Path, alias: str, **over: Any) -> dict[str, Any]:
    command = [str(binary), "-m", str(model), "-a", alias, "-c", "2048", "-t", "1"]
    return {
        "name": name,
        "engine": "llamacpp",
        "engine_version": "b10798",
        "served_model": alias,
        "instances": [
            {
                "launch": {"command": command, "startup_timeout": "120s"},
                "pod": {"image": "ghcr.io/ggml-org/llama.cpp:server", "grace_period": 5},
            }
        ],
        **over,
    }


class Served:
    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.runners: list[GatewayRunner] = []

    async def start(self, config: dict[str, Any]) -> RunningGateway:
        app = create_app(
            GatewayConfig.model_validate({"kubernetes": {"namespace": NS}, **config}),
            KEY,
            env={"KUBECONFIG": str(self.kube.kubeconfig), "HOME": "/nonexistent"},
        )
        runner = GatewayRunner(app)
        await runner.setup()
        self.runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        return RunningGateway(f"http://{host}:{port}", KEY, app[GATEWAY_KEY])

    async def stop(self, gw: RunningGateway) -> None:
        runner = next(r for r in self.runners if r.app[GATEWAY_KEY] is gw.gateway)
        self.runners.remove(runner)
        await runner.cleanup()


@pytest.fixture
async def served(kube: Kube) -> AsyncIterator[Served]:
    s = Served(kube)
    try:
        yield s
    finally:
        for r in s.runners:
            await r.cleanup()


async def test_a_llama_server_pod_starts_for_a_request_stops_when_idle_and_switches_in_a_budget(
    kube: Kube, served: Served, llama_server_binary: Path, llama_models: Path
) -> None:
    model = llama_models / "tiny.gguf"
    memory = {"ready": "1GiB"}
    gw = await served.start(
        {
            "resources": {"memory_budget": "1GiB"},
            "deployments": [
                pod_deployment("Org/a", llama_server_binary, model, "tiny-a", memory=memory,
                               lifecycle={"ready_idle_timeout": "2s"}),
                pod_deployment("b", llama_server_binary, model, "tiny-b", memory=memory),
            ],
        }
    )  # fmt: skip
    assert kube.pods() == []
    assert (await ask(gw, "Org/a"))["model"] == "Org/a"
    (pod,) = kube.pods("Org/a")
    pid = kube.kubelet.processes[pod["metadata"]["name"]]
    row = (deployment_status(gw.gateway.fleet, "Org/a") or {})["instances"][0]
    assert row["pod"]["phase"] == "Running" and row["pod"]["node"] == "cpu-1"
    # the budget holds one: b's request switches a out (its pod deleted) and b in
    assert (await ask(gw, "b"))["model"] == "b"
    assert kube.pods("Org/a") == [] and not alive(pid)
    (b_pod,) = kube.pods("b")
    assert (await ask(gw, "Org/a"))["model"] == "Org/a"
    assert kube.pods("b") == []
    # a's idle clock stops it: its pod deleted, its process gone
    (a_pod,) = kube.pods("Org/a")
    a_pid = kube.kubelet.processes[a_pod["metadata"]["name"]]
    await eventually(lambda: kube.pods() == [], within=30)
    assert not alive(a_pid)
    assert b_pod["metadata"]["uid"] != a_pod["metadata"]["uid"]


async def test_a_crash_a_cut_watch_and_a_gateway_restart_on_a_llama_server_pod(
    kube: Kube, served: Served, llama_server_binary: Path, llama_models: Path
) -> None:
    config = {
        "deployments": [
            pod_deployment("my-model", llama_server_binary, llama_models / "tiny.gguf", "tiny")
        ]
    }
    gw = await served.start(config)
    await ask(gw, "my-model")
    (first,) = kube.pods()
    # the engine crashes, and the watch is cut and expired meanwhile: the exit is still heard
    kube.api.fail_next("GET", "/pods", 410)
    kube.api.drop_watches()
    await kube.kubelet.kill(first["metadata"]["name"], NS, signal.SIGKILL)
    await eventually(lambda: all(p["metadata"]["uid"] != first["metadata"]["uid"] for p in kube.pods()), within=30)  # fmt: skip
    await ask(gw, "my-model")  # a new pod, started for it
    (second,) = kube.pods()
    assert second["metadata"]["uid"] != first["metadata"]["uid"]
    pid = kube.kubelet.processes[second["metadata"]["name"]]
    # a restarted gateway takes the running pod up: no new pod, the same process answers
    await served.stop(gw)
    assert alive(pid) and len(kube.pods()) == 1
    again = await served.start(config)
    row = (deployment_status(again.gateway.fleet, "my-model") or {})["instances"][0]
    assert row["lifecycle"] == "ready"
    await ask(again, "my-model")
    (still,) = kube.pods()
    assert still["metadata"]["uid"] == second["metadata"]["uid"] and alive(pid)
