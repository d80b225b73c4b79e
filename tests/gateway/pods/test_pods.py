"""Engines as Kubernetes pods, end to end: the gateway's pod runner, through the real
`kubernetes_asyncio` client, against the Kubernetes API fake (``tests/kube/``) with its fake
scheduler and kubelet, which runs each pod's command as a real process (here the launchable
fake engine; ``test_pods_live.py`` runs a real llama-server). Every pod the gateway creates is
checked against Kubernetes' own Pod schema by the fake API server (422 otherwise)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from capyctl_gateway._config import GatewayConfig
from capyctl_gateway._http.app import GATEWAY_KEY, create_app
from capyctl_gateway._lifecycle.operator import deployments_list, operator_stop
from capyctl_gateway._management.render import print_list, print_status
from capyctl_gateway._management.status import deployment_status
from capyctl_gateway._pods import podrun
from capyctl_gateway._pods.manifest import NAME
from tests.eventually import eventually
from tests.gateway.conftest import COLLECTOR, KEY, Gw, _serve
from tests.gateway.lifecycle.test_lifecycle import chat, launched
from tests.kube.apiserver import FakeApiServer
from tests.kube.conftest import alive
from tests.kube.kubelet import FakeKubelet
from tests.kube.scheduler import FakeNode

pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]
NS = "serving"


def pod_deployment(name: str = "my-model", *, served: str = "tiny", **over: Any) -> dict[str, Any]:
    """The launchable fake engine's deployment (``launched``), its instance run as a pod."""
    dep = launched(name, served=served, **over)
    dep["instances"][0]["pod"] = {
        "image": "capyctl/fake-engine:test",
        "resources": {"limits": {"nvidia.com/gpu": 1}},
        "grace_period": 5,
    }
    return dep


class Cluster:
    def __init__(self, api: FakeApiServer, kubelet: FakeKubelet, kubeconfig: Path) -> None:
        self.api, self.kubelet, self.kubeconfig = api, kubelet, kubeconfig

    @property
    def env(self) -> dict[str, str]:
        return {"KUBECONFIG": str(self.kubeconfig), "HOME": "/nonexistent"}

    def pods(self, name: str | None = None) -> list[dict[str, Any]]:
        found = self.api.store.list_pods(NS)
        return [p for p in found if name is None or p["metadata"]["annotations"][NAME] == name]


@contextlib.asynccontextmanager
async def fake_cluster(tmp_path: Path, *nodes: FakeNode) -> AsyncIterator[Cluster]:
    async with FakeApiServer() as api, FakeKubelet(api, list(nodes), time_scale=0.05) as kubelet:
        yield Cluster(api, kubelet, api.kubeconfig(tmp_path / "kubeconfig", NS))


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    gpus = {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "2"}
    async with fake_cluster(tmp_path, FakeNode("gpu-1", allocatable=gpus)) as c:
        yield c


def config(*deps: dict[str, Any]) -> dict[str, Any]:
    return {"kubernetes": {"namespace": NS}, "deployments": list(deps)}


def pod_row(gw: Gw, name: str = "my-model") -> dict[str, Any]:
    doc = deployment_status(gw.gateway.fleet, name)
    assert doc is not None
    row = doc["instances"][0]
    return dict(row)


async def test_the_first_request_starts_a_pod_that_serves_and_a_stop_deletes_it(
    cluster: Cluster, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway(config(pod_deployment()), env=cluster.env)
    assert cluster.pods() == []  # nothing runs before a request asks for it
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
        assert "tiny" in r.json()["choices"][0]["message"]["content"]
    (pod,) = cluster.pods()
    name = pod["metadata"]["name"]
    assert pod["status"]["phase"] == "Running" and pod["spec"]["nodeName"] == "gpu-1"
    pid = cluster.kubelet.processes[name]
    row = pod_row(gw)
    assert row["pod"]["name"] == name and row["pod"]["node"] == "gpu-1"
    assert row["pod"]["phase"] == "Running"
    fleet = gw.gateway.fleet
    listing = deployments_list(fleet.lifecycle, fleet.routes, None)
    text = Console(width=80, record=True)
    print_list(text, listing)
    (listed,) = listing["deployments"]
    assert listed["run_by"] == "the gateway (pods)"
    assert f"my-model instance 0: pod {NS}/{name} on node gpu-1, Running" in text.export_text()
    await operator_stop(gw.gateway.fleet.lifecycle, "my-model", known=True)
    assert cluster.pods() == []  # the stop returned once the pod was gone: proven
    assert not alive(pid)


async def test_an_unschedulable_pod_is_shown_and_its_waiters_hear_why(
    cluster: Cluster, make_gateway: MakeGateway
) -> None:
    dep = pod_deployment()
    dep["instances"][0]["pod"]["resources"] = {"limits": {"nvidia.com/gpu": 3}}
    gw = await make_gateway(config(dep) | {"queue": {"request_deadline": "2s"}}, env=cluster.env)
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat())
    assert r.status_code == 503, r.text
    message = r.json()["message"]
    assert "Insufficient nvidia.com/gpu" in message and "Unschedulable" in message
    row = pod_row(gw)
    assert "Insufficient nvidia.com/gpu" in row["pod"]["waiting"]
    assert row["pod"]["phase"] == "Pending"
    text = Console(width=80, record=True)
    doc = deployment_status(gw.gateway.fleet, "my-model")
    assert doc is not None
    print_status(text, doc)
    shown = text.export_text()
    assert f"pod {NS}/{row['pod']['name']}: Pending" in shown
    assert (
        "it waits: Unschedulable: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu" in shown
    )


async def test_a_crashed_pod_is_replaced_for_the_next_request(
    cluster: Cluster, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway(config(pod_deployment()), env=cluster.env)
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        (first,) = cluster.pods()
        await cluster.kubelet.kill(first["metadata"]["name"], NS, signal.SIGKILL)

        def deleted() -> bool:  # the failed pod is deleted by the gateway
            return all(p["metadata"]["uid"] != first["metadata"]["uid"] for p in cluster.pods())

        await eventually(deleted)
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
    (second,) = cluster.pods()
    assert second["metadata"]["uid"] != first["metadata"]["uid"]


async def test_the_watch_survives_a_cut_and_a_compaction(
    cluster: Cluster, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway(config(pod_deployment()), env=cluster.env)
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        cluster.api.fail_next("GET", "/pods", 410)  # the watch's renewal: its version expired
        cluster.api.drop_watches()
        (pod,) = cluster.pods()
        await cluster.kubelet.kill(pod["metadata"]["name"], NS, signal.SIGKILL)

        def heard() -> bool:  # the exit was heard through a new list and watch
            return all(p["metadata"]["uid"] != pod["metadata"]["uid"] for p in cluster.pods())

        await eventually(heard)
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
    gets = [q for m, path, q in cluster.api.calls if m == "GET" and path.endswith("/pods")]
    watches = [q for q in gets if q.get("watch", "").lower() in ("true", "1")]
    assert len(watches) >= 2 and len(gets) - len(watches) >= 2  # watched again, listed again


async def test_a_restarted_gateway_takes_up_its_running_pod_and_deletes_strangers(
    cluster: Cluster, make_gateway: MakeGateway
) -> None:
    first = create_app(
        GatewayConfig.model_validate(config(pod_deployment(), pod_deployment("gone"))),
        KEY,
        env=cluster.env,
        collector_options=COLLECTOR,
    )
    runner, url = await _serve(first, gateway=True)
    try:
        async with Gw(url, KEY, first[GATEWAY_KEY]).client() as c:
            for model in ("my-model", "gone"):
                assert (await c.post("/v1/chat/completions", json=chat(model))).status_code == 200
    finally:
        await runner.cleanup()  # its pods outlive it, as a host's engines do
    stranger, kept = sorted(cluster.pods(), key=lambda p: p["metadata"]["annotations"][NAME])
    assert stranger["metadata"]["annotations"][NAME] == "gone"
    assert kept["status"]["phase"] == stranger["status"]["phase"] == "Running"
    stranger_pid = cluster.kubelet.processes[stranger["metadata"]["name"]]
    # the next run no longer names "gone": its pod goes; my-model's is taken up as it runs
    second = await make_gateway(config(pod_deployment()), env=cluster.env)
    row = pod_row(second)
    assert row["lifecycle"] == "ready" and row["pod"]["name"] == kept["metadata"]["name"]
    creates = sum(1 for m, _, _ in cluster.api.calls if m == "POST")
    async with second.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    assert sum(1 for m, _, _ in cluster.api.calls if m == "POST") == creates  # no new pod
    await eventually(
        lambda: [p["metadata"]["uid"] for p in cluster.pods()] == [kept["metadata"]["uid"]]
    )
    assert not alive(stranger_pid)


@pytest.fixture
async def two_nodes(tmp_path: Path) -> AsyncIterator[Cluster]:
    one = {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"}
    nodes = FakeNode("gpu-1", allocatable=one), FakeNode("gpu-2", allocatable=one)
    async with fake_cluster(tmp_path, *nodes) as c:
        yield c


async def test_an_evicted_pod_and_a_lost_node_are_exits_and_the_lost_ones_stop_stays_unproven(
    two_nodes: Cluster, make_gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(podrun, "STOP_PROOF_MARGIN_S", 0.5)  # a lost node's pod never goes
    cluster = two_nodes
    gw = await make_gateway(config(pod_deployment()), env=cluster.env)
    life = gw.gateway.fleet.lifecycle.lives["my-model"]
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        (first,) = cluster.pods()
        await cluster.kubelet.evict(first["metadata"]["name"], NS)
        await eventually(lambda: cluster.pods() == [])  # an exit: the failed pod deleted
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        (second,) = cluster.pods()
        lost_node = second["spec"]["nodeName"]
        await cluster.kubelet.lose_node(lost_node)
        # Kubernetes deletes the lost node's pod, which stays Terminating: the gateway hears an
        # exit, and its own delete cannot be proven (its memory stays counted: unconfirmed)
        await eventually(lambda: life.launched[0].unconfirmed)
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
    pods = {p["metadata"]["name"]: p for p in cluster.pods()}
    assert second["metadata"]["name"] in pods  # still Terminating on its lost node
    (third,) = [p for n, p in pods.items() if n != second["metadata"]["name"]]
    assert third["spec"]["nodeName"] != lost_node
    await cluster.kubelet.restore_node(lost_node)
    await eventually(
        lambda: [p["metadata"]["uid"] for p in cluster.pods()] == [third["metadata"]["uid"]]
    )


async def test_a_lost_nodes_pod_gone_at_last_frees_what_its_unproven_stop_kept_counted(
    two_nodes: Cluster, make_gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(podrun, "STOP_PROOF_MARGIN_S", 0.5)
    cluster = two_nodes
    dep = pod_deployment(memory={"ready": "1GiB"})
    gw = await make_gateway(config(dep) | {"resources": {"memory_budget": "1GiB"}}, env=cluster.env)
    lifecycle = gw.gateway.fleet.lifecycle
    (lc,) = lifecycle.lives["my-model"].launched
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    (pod,) = cluster.pods()
    await cluster.kubelet.lose_node(pod["spec"]["nodeName"])
    await eventually(lambda: lc.unconfirmed and lc.state.value in ("stopped", "failed"))
    assert lifecycle.budget.held() == 2**30  # its stop unproven: its memory stays counted
    await cluster.kubelet.restore_node(pod["spec"]["nodeName"])  # the pod goes at last
    await eventually(lambda: not lc.unconfirmed)
    assert cluster.pods() == [] and lifecycle.budget.held() == 0
