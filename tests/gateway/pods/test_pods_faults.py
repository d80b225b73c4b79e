"""The pod runner under the Kubernetes API's faults (``tests/kube/``'s fake API server and
kubelet, real engine processes): deletes the API refuses, creates whose answer is lost, a stop
of a pod still waiting for a node, a defect in the pod watch, starts that never began.

What each test checks is the cluster's own history after the fact (the fake API server's store
keeps every change): which pods existed together, and what the gateway's memory budget held.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from rich.console import Console

from capyctl_gateway._config import GatewayConfig
from capyctl_gateway._http.app import GATEWAY_KEY, create_app
from capyctl_gateway._lifecycle.operator import operator_start, operator_stop
from capyctl_gateway._lifecycle.rest import quiesce
from capyctl_gateway._lifecycle.states import InstanceState
from capyctl_gateway._management.render import print_status
from capyctl_gateway._management.status import deployment_status
from capyctl_gateway._pods import creating, deletes, watch
from capyctl_gateway._pods.manifest import NAME
from capyctl_gateway._pods.podstate import serving
from capyctl_gateway._pods.watch import PodWatch
from tests.eventually import eventually
from tests.gateway.conftest import COLLECTOR, KEY, Gw, _serve
from tests.gateway.lifecycle.test_lifecycle import chat, management
from tests.gateway.lifecycle.test_lifecycle_model import (
    DOCUMENTED,
    NAMES,
    SEED,
    Run,
    play,
    schedule,
    summary,
)
from tests.gateway.lifecycle.test_lifecycle_model import watch as model_watch
from tests.gateway.lifecycle.test_lifecycle_races import engines_running, served
from tests.gateway.pods.test_pods import NS, Cluster, MakeGateway, cluster, config, pod_deployment
from tests.kube.apiserver import FakeApiServer
from tests.kube.kubelet import FakeKubelet
from tests.kube.scheduler import FakeNode

pytestmark = pytest.mark.anyio
__all__ = ["cluster"]  # the fixture, used by name
GiB = 2**30
FAULTY_STEPS = 36
"""Steps of the lifecycle's schedule under API faults in CI (``CAPYCTL_MODEL_STEPS`` sets it)."""


def together(c: Cluster) -> list[set[str]]:
    """Every set of pods that existed at one time (by deployment name, Terminating ones with a
    ``~``), replayed from the store's history of changes."""
    pods: dict[str, dict[str, Any]] = {}
    seen: list[set[str]] = []
    for change in c.api.store.history:
        name = change.obj["metadata"]["name"]
        if change.type == "DELETED":
            pods.pop(name, None)
        else:
            pods[name] = change.obj
        now = set()
        for pod in pods.values():
            mark = "~" if pod["metadata"].get("deletionTimestamp") else ""
            now.add(mark + pod["metadata"]["annotations"][NAME] + "/" + pod["metadata"]["name"])
        seen.append(now)
    return seen


def running(at: set[str], deployment: str) -> list[str]:
    """The pods of ``deployment`` that existed and were not being deleted."""
    return [p for p in at if p.startswith(deployment + "/")]


def creates(c: Cluster) -> int:
    return sum(1 for m, path, _ in c.api.calls if m == "POST" and path.endswith("/pods"))


def row(gw: Any, name: str = "my-model") -> dict[str, Any]:
    doc = deployment_status(gw.gateway.fleet, name)
    assert doc is not None
    return dict(doc["instances"][0])


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deletes, "OWED_FIRST_S", 0.05)
    monkeypatch.setattr(deletes, "OWED_MAX_S", 0.2)


# -- deletes the API refuses --------------------------------------------------------------------
@pytest.mark.parametrize("status", [500, 429, 503])
async def test_a_refused_delete_is_tried_again_until_the_pod_is_gone_and_its_memory_waits(
    cluster: Cluster, make_gateway: MakeGateway, status: int
) -> None:
    dep = pod_deployment(memory={"ready": "1GiB"})
    gw = await make_gateway(config(dep) | {"resources": {"memory_budget": "1GiB"}}, env=cluster.env)
    lifecycle = gw.gateway.fleet.lifecycle
    (lc,) = lifecycle.lives["my-model"].launched
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    (pod,) = cluster.pods()
    cluster.api.fail_next("DELETE", "/pods/", status, times=3)
    with anyio.fail_after(30):
        await operator_stop(lifecycle, "my-model", known=True)
    # refused: the pod runs on, the stop is unproven, its memory counted, status says why
    assert [p["metadata"]["uid"] for p in cluster.pods()] == [pod["metadata"]["uid"]]
    assert lc.unconfirmed and lifecycle.budget.held() == GiB
    (owed,) = row(gw)["pod_deletes_owed"]
    assert owed["name"] == pod["metadata"]["name"]
    assert owed["why"].startswith("stopped by an operator (a stop here): its delete failed (")
    text = Console(width=200, record=True)
    doc = deployment_status(gw.gateway.fleet, "my-model")
    assert doc is not None
    print_status(text, doc)
    assert f"pod {NS}/{owed['name']}: its delete is owed for " in text.export_text()
    # tried again (three refusals in all, the fourth try taken) until the watch shows it gone
    await eventually(lambda: cluster.pods() == [] and not lc.unconfirmed)
    assert lifecycle.budget.held() == 0 and "pod_deletes_owed" not in row(gw)
    deletes_sent = [m for m, path, _ in cluster.api.calls if m == "DELETE"]
    assert len(deletes_sent) == 4


async def test_a_start_makes_no_second_pod_beside_one_whose_delete_is_owed(
    cluster: Cluster, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway(config(pod_deployment()), env=cluster.env)
    lifecycle = gw.gateway.fleet.lifecycle
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        cluster.api.fail_next("DELETE", "/pods/", 500, times=6)
        await operator_stop(lifecycle, "my-model", known=True)
        assert len(cluster.pods()) == 1  # its delete is owed
        await operator_start(lifecycle, "my-model", known=True)  # waits for the owed delete
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
    history = together(cluster)
    assert max(len(running(at, "my-model")) for at in history) == 1
    assert creates(cluster) == 2 and len(cluster.pods()) == 1


# -- a failed start's pod ------------------------------------------------------------------------
async def test_a_failed_starts_pod_keeps_its_memory_until_it_is_gone(
    cluster: Cluster, make_gateway: MakeGateway
) -> None:
    slow = pod_deployment("slow", extra=["--slow-start", "60"], memory={"ready": "1GiB"})
    slow["instances"][0]["launch"]["startup_timeout"] = "2s"
    other = pod_deployment("other", served="other", memory={"ready": "1GiB"})
    cfg = config(slow, other) | {"resources": {"memory_budget": "1GiB"}}
    gw = await make_gateway(cfg, env=cluster.env)
    lifecycle = gw.gateway.fleet.lifecycle
    (lc,) = lifecycle.lives["slow"].launched
    cluster.api.fail_next("DELETE", "/pods/", 500, times=4)  # its pod outlives its failed start
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat("slow"))
        assert r.status_code == 500 and r.json()["code"] == "activation_failed", r.text
        assert lc.state is InstanceState.FAILED and lc.unconfirmed
        assert lifecycle.budget.held() == GiB  # its pod may still run: its memory is counted
        r = await c.post("/v1/chat/completions", json=chat("other"))  # waits until it is gone
        assert r.status_code == 200, r.text
    assert not lifecycle.lives["slow"].launched[0].unconfirmed  # gone: its memory freed
    for at in together(cluster):  # the budget holds one: never both at once
        assert not (any("slow/" in p for p in at) and any("other/" in p for p in at)), at


# -- creates whose answer is lost ----------------------------------------------------------------
async def test_a_create_whose_answer_is_lost_finds_its_pod_by_name(
    cluster: Cluster, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway(config(pod_deployment()), env=cluster.env)
    cluster.api.lose_next("POST", "/pods")
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
    (pod,) = cluster.pods()  # the one the lost create made: taken up, not a second one
    assert row(gw)["pod"]["name"] == pod["metadata"]["name"]
    assert creates(cluster) == 2  # the second answered 409: the first had made it
    await operator_stop(gw.gateway.fleet.lifecycle, "my-model", known=True)
    assert cluster.pods() == []


async def test_a_create_never_answered_deletes_what_it_may_have_made(
    cluster: Cluster, make_gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(creating, "CREATE_TRIES", 2)
    dep = pod_deployment(memory={"ready": "1GiB"})
    gw = await make_gateway(config(dep) | {"resources": {"memory_budget": "1GiB"}}, env=cluster.env)
    lifecycle = gw.gateway.fleet.lifecycle
    (lc,) = lifecycle.lives["my-model"].launched
    cluster.api.lose_next("POST", "/pods", times=1)
    cluster.api.fail_next("POST", "/pods", 504, times=1)
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat())
    assert r.status_code == 500, r.text
    body = r.json()
    assert body["code"] == "activation_failed"
    assert "the Kubernetes API did not answer its pod's create" in body["message"]
    assert "engine's last words" not in body["message"]  # no engine ran
    # the lost create did make a pod: it is deleted by name, its memory counted until then
    await eventually(lambda: cluster.pods() == [] and not lc.unconfirmed)
    assert lifecycle.budget.held() == 0
    assert any(len(running(at, "my-model")) == 1 for at in together(cluster))


async def test_a_stop_during_a_creates_tries_deletes_what_a_lost_try_made(
    cluster: Cluster, make_gateway: MakeGateway
) -> None:
    dep = pod_deployment(memory={"ready": "1GiB"})
    gw = await make_gateway(config(dep) | {"resources": {"memory_budget": "1GiB"}}, env=cluster.env)
    lifecycle = gw.gateway.fleet.lifecycle
    cluster.api.lose_next("POST", "/pods")  # made, its answer lost
    cluster.api.fail_next("POST", "/pods", 503, times=100)  # and the tries after it refused
    async with gw.client() as c, anyio.create_task_group() as tg:
        answers: list[Any] = []

        async def ask() -> None:
            answers.append(await c.post("/v1/chat/completions", json=chat()))

        tg.start_soon(ask)
        await eventually(lambda: len(cluster.pods()) == 1 and creates(cluster) >= 2)
        await operator_stop(lifecycle, "my-model", known=True)  # abandons the tries
    (r,) = answers
    assert r.status_code == 409, r.text
    await eventually(lambda: cluster.pods() == [] and lifecycle.budget.held() == 0)


# -- a stop while its pod waits for a node ------------------------------------------------------
async def test_a_stop_of_a_pending_pod_deletes_it_at_once(
    cluster: Cluster, make_gateway: MakeGateway
) -> None:
    dep = pod_deployment(memory={"ready": "1GiB"})
    dep["instances"][0]["pod"]["resources"] = {"limits": {"nvidia.com/gpu": 3}}  # fits nowhere
    dep["instances"][0]["launch"]["startup_timeout"] = "10m"
    gw = await make_gateway(config(dep) | {"resources": {"memory_budget": "1GiB"}}, env=cluster.env)
    lifecycle = gw.gateway.fleet.lifecycle
    (lc,) = lifecycle.lives["my-model"].launched
    async with gw.client() as c, anyio.create_task_group() as tg:
        answers: list[Any] = []

        async def ask() -> None:
            answers.append(await c.post("/v1/chat/completions", json=chat()))

        tg.start_soon(ask)
        await eventually(lambda: "waiting" in (row(gw).get("pod") or {}))
        with anyio.fail_after(20):  # not the 10 minutes of its startup timeout
            await operator_stop(lifecycle, "my-model", known=True)
        assert cluster.pods() == []
    (r,) = answers
    assert r.status_code == 409 and r.json()["code"] == "deployment_stopped", r.text
    assert lc.state is InstanceState.STOPPED and not lc.unconfirmed
    assert lifecycle.budget.held() == 0


# -- the pod watch ------------------------------------------------------------------------------
async def test_a_defect_in_the_pod_watch_is_logged_and_it_runs_again(
    cluster: Cluster,
    make_gateway: MakeGateway,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gw = await make_gateway(config(pod_deployment()), env=cluster.env)
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    real = PodWatch._apply
    broke = asyncio.Event()

    def defect(self: PodWatch, kind: str, obj: dict[str, Any]) -> None:
        monkeypatch.setattr(PodWatch, "_apply", real)  # once
        broke.set()
        raise RuntimeError("a defect in the watch")

    monkeypatch.setattr(PodWatch, "_apply", defect)
    monkeypatch.setattr(watch, "BACKOFF_MAX_S", 0.5)
    caplog.set_level(logging.WARNING, "capyctl_gateway")
    cluster.api.bookmark()  # the next event meets the defect
    (pod,) = cluster.pods()
    await cluster.kubelet.kill(pod["metadata"]["name"], NS, 9)
    with anyio.fail_after(10):
        await broke.wait()
    faults = gw.gateway.fleet.tasks.faults
    await eventually(lambda: faults["pod_watch"] == 1)
    # it runs again: the engine's exit is heard, and the next request gets a new pod
    (lc,) = gw.gateway.fleet.lifecycle.lives["my-model"].launched
    await eventually(lambda: lc.state is not InstanceState.READY)
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
    (second,) = cluster.pods()
    assert second["metadata"]["uid"] != pod["metadata"]["uid"]
    assert "pod_watch" not in row(gw)
    assert any("a defect in the watch" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


# -- starts that never began ----------------------------------------------------------------------
async def test_a_refused_create_says_kubernetes_reason_and_no_engine_ran(
    cluster: Cluster, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway(config(pod_deployment()), env=cluster.env)
    cluster.api.fail_next("POST", "/pods", 403)
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat())
    assert r.status_code == 500, r.text
    assert r.json()["message"] == (
        "deployment my-model could not be started: Kubernetes refused its pod (Forbidden)"
    )
    assert cluster.pods() == []


async def test_a_transient_create_error_is_tried_again_and_switches_nothing_for_nothing(
    cluster: Cluster, make_gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = pod_deployment("a", served="a", memory={"ready": "1GiB"})
    b = pod_deployment("b", served="b", memory={"ready": "1GiB"})
    gw = await make_gateway(
        config(a, b) | {"resources": {"memory_budget": "1GiB"}}, env=cluster.env
    )
    lives = gw.gateway.fleet.lifecycle.lives
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat("a"))).status_code == 200
        cluster.api.fail_next("POST", "/pods", 503)  # once: the create is tried again
        r = await c.post("/v1/chat/completions", json=chat("b"))
        assert r.status_code == 200, r.text
        assert [p["metadata"]["annotations"][NAME] for p in cluster.pods()] == ["b"]
        # the API down for good: nothing is switched out for a start that cannot begin
        monkeypatch.setattr(watch, "BACKOFF_MAX_S", 0.5)
        cluster.api.fail_next("GET", "/pods", 503, times=10_000)
        cluster.api.drop_watches()
        w = gw.gateway.fleet.lifecycle.lives["b"].launched[0].inst.runner
        await eventually(lambda: w.cannot_start() is not None)
        r = await c.post("/v1/chat/completions", json=chat("a"))
        assert r.status_code == 503 and r.json()["code"] == "unavailable", r.text
        assert "cannot be started now: the Kubernetes API cannot be reached" in r.json()["message"]
        assert lives["b"].state == "ready"  # b serves on
        assert (await c.post("/v1/chat/completions", json=chat("b"))).status_code == 200
        cluster.api.clear_faults()
        await eventually(lambda: w.cannot_start() is None)
        assert (await c.post("/v1/chat/completions", json=chat("a"))).status_code == 200


# -- a restart that finds two pods for one instance ---------------------------------------------
async def test_a_restarted_gateway_takes_up_one_pod_of_an_instance_and_deletes_the_other(
    cluster: Cluster, make_gateway: MakeGateway
) -> None:
    first = create_app(
        GatewayConfig.model_validate(config(pod_deployment())),
        KEY,
        env=cluster.env,
        collector_options=COLLECTOR,
    )
    runner, url = await _serve(first, gateway=True)
    try:
        async with Gw(url, KEY, first[GATEWAY_KEY]).client() as c:
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    finally:
        await runner.cleanup()  # its pod outlives it
    (kept,) = cluster.pods()
    twin = copy.deepcopy(kept)  # a second pod of the same instance, as a lost create made
    twin["metadata"] = {
        k: v for k, v in twin["metadata"].items() if k in ("labels", "annotations", "namespace")
    }
    twin["metadata"]["name"] = kept["metadata"]["name"] + "-twin"
    twin.pop("status", None)
    twin["spec"].pop("nodeName", None)
    cluster.api.store.create_pod(NS, twin)
    await eventually(lambda: all(serving(p) for p in cluster.pods()) and len(cluster.pods()) == 2)
    cluster.api.fail_next("DELETE", "/pods/", 500)  # the first try at the extra one fails
    second = await make_gateway(config(pod_deployment()), env=cluster.env)
    assert row(second)["lifecycle"] == "ready"
    await eventually(lambda: len(cluster.pods()) == 1)
    (left,) = cluster.pods()
    assert row(second)["pod"]["name"] == left["metadata"]["name"]  # the one taken up remains
    async with second.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    assert creates(cluster) == 1  # the first gateway's: nothing new was made


# -- the lifecycle over pods, the API failing beside it ---------------------------------------
async def test_the_lifecycle_over_pods_under_api_faults_loses_nothing_and_never_overcommits(
    make_gateway: MakeGateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pods model test's seeded schedule (concurrent requests, hang-ups, crashes, operator
    commands) against three deployments under a budget for two, while the API refuses deletes
    and creates, loses creates' answers and cuts the watch at random. Every request gets 200 or
    a documented refusal; at no point of the cluster's history do more pods exist than the
    budget holds, or two running pods for one instance; once all is stopped, no pod is left
    and nothing is held."""
    monkeypatch.setattr(watch, "BACKOFF_MAX_S", 0.5)
    steps = int(os.environ.get("CAPYCTL_MODEL_STEPS", FAULTY_STEPS))
    rng = random.Random(SEED)
    print(f"the lifecycle over pods under API faults: seed {SEED}, {steps} steps")  # noqa: T201
    nodes = [FakeNode("gpu-1", allocatable={"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "4"})]
    async with FakeApiServer() as api, FakeKubelet(api, nodes, time_scale=0.05):
        kubeconfig = api.kubeconfig(tmp_path / "kubeconfig", NS)
        memory = {"ready": "1GiB", "parked": 0}
        deps = [
            pod_deployment(n, served=served(n), memory=memory, lifecycle={"drain_timeout": "2s"})
            for n in NAMES
        ]
        cfg = config(*deps) | {
            "resources": {"memory_budget": "2GiB"},
            "queue": {"request_deadline": "20s"},
        }
        gw = await make_gateway(cfg, env={"KUBECONFIG": str(kubeconfig)})
        run = Run()
        model_watch(gw, run)
        runner, base = await management(gw)
        injected: list[str] = []

        async def faults() -> None:
            while True:
                await anyio.sleep(rng.uniform(0.2, 0.8))  # the faults' own pace
                roll = rng.random()
                if roll < 0.35:
                    api.fail_next(
                        "DELETE", "/pods/", rng.choice([500, 429, 503]), rng.randint(1, 3)
                    )
                    injected.append("delete refused")
                elif roll < 0.55:
                    api.lose_next("POST", "/pods")
                    injected.append("create's answer lost")
                elif roll < 0.7:
                    api.fail_next("POST", "/pods", rng.choice([500, 503, 429]))
                    injected.append("create refused")
                elif roll < 0.85:
                    api.drop_watches()
                    injected.append("watch cut")
                else:
                    api.fail_next("GET", "/pods", 503, rng.randint(1, 2))
                    injected.append("list or watch refused")

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(faults)
                await play(gw, base, schedule(random.Random(SEED), steps, 1.0), run)
                tg.cancel_scope.cancel()
            api.clear_faults()
            lifecycle = gw.gateway.fleet.lifecycle
            with anyio.fail_after(60):
                for life in lifecycle.lives.values():
                    await quiesce(life)
            assert run.broken == []
            print(summary(run), "faults:", Counter(injected))  # noqa: T201
            for a in run.asks:  # a fault answers a documented refusal, never anything else
                if a.hang is None and a.status not in (None, 200):
                    assert a.code in DOCUMENTED.get(a.status, set()), a
            auth = {"Authorization": f"Bearer {gw.key}"}
            async with httpx.AsyncClient(headers=auth, timeout=60) as m:
                for name in NAMES:
                    assert (await m.post(f"{base}/deployments/{name}/stop")).status_code == 200
            await eventually(lambda: api.store.list_pods(NS) == [], within=30)
            await eventually(lambda: lifecycle.budget.held() == 0, within=10)
            for name in NAMES:
                assert engines_running(served(name)) == []
        finally:
            await runner.cleanup()
        history = together(Cluster(api, None, kubeconfig))  # type: ignore[arg-type]
        for at in history:
            assert len(at) <= 2, at  # never more pods than the budget holds, Terminating or not
            for name in NAMES:
                assert len(running(at, name)) <= 1, at
