"""The lifecycle's model test (``test_lifecycle_model.py``) over pod runners: the same seeded
random schedule of concurrent requests (streamed and whole, short and long, clients hanging up
before the head or mid-stream, requests that crash their engine) and operator starts, stops and
parks, against three deployments whose engines run as pods under a memory budget that holds
two, on the Kubernetes API fake with its fake kubelet (``tests/kube/``), which runs each pod as
a real process; in one process, and with two workers behind their authority.

Checked at every transition as on one machine: never more held than the budget, never two
engines for one instance, never more engines awake than the budget holds. At the end: every
request got 200 or a documented refusal, only a stop or a crash cut one, ``status`` names the
pod that really runs, and once every deployment is stopped no pod and no engine process is
left, and every cut request has settled on its pod's proven deletion.
"""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from capyctl_gateway._lifecycle.rest import quiesce
from capyctl_gateway._management.status import deployment_status
from capyctl_gateway._pods.manifest import NAME
from tests.gateway.conftest import WORKERS, Gw
from tests.gateway.lifecycle.test_lifecycle import management
from tests.gateway.lifecycle.test_lifecycle_model import (
    NAMES,
    SEED,
    Run,
    judge,
    play,
    schedule,
    summary,
    watch,
)
from tests.gateway.lifecycle.test_lifecycle_races import engines_running, served
from tests.gateway.pods.test_pods import pod_deployment
from tests.kube.apiserver import FakeApiServer
from tests.kube.kubelet import FakeKubelet
from tests.kube.scheduler import FakeNode

pytestmark = pytest.mark.anyio
workers = WORKERS  # one process, and two workers behind their authority
MakeGateway = Callable[..., Awaitable[Gw]]
STEPS = 36
NS = "model"


@pytest.fixture
async def kube(tmp_path: Path) -> AsyncIterator[tuple[FakeApiServer, Path]]:
    nodes = [FakeNode("gpu-1", allocatable={"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "4"})]
    async with FakeApiServer() as api, FakeKubelet(api, nodes, time_scale=0.05):
        yield api, api.kubeconfig(tmp_path / "kubeconfig", NS)


def deployment(name: str, **over: Any) -> dict[str, Any]:
    memory = {"ready": "1GiB", "parked": 0}
    return pod_deployment(name, served=served(name), memory=memory, **over)


def pods_of(api: FakeApiServer, name: str) -> list[dict[str, Any]]:
    return [p for p in api.store.list_pods(NS) if p["metadata"]["annotations"][NAME] == name]


async def test_the_lifecycle_over_pods_under_a_random_schedule_loses_no_request(
    kube: tuple[FakeApiServer, Path], make_gateway: MakeGateway
) -> None:
    api, kubeconfig = kube
    steps = int(os.environ.get("CAPYCTL_MODEL_STEPS", STEPS))
    print(f"lifecycle model over pods: seed {SEED}, {steps} steps")  # noqa: T201
    deps = [
        deployment("a", lifecycle={"drain_timeout": "2s"}),
        deployment("b", lifecycle={"drain_timeout": "2s", "ready_idle_timeout": "1s"}),
        deployment("c", lifecycle={"drain_timeout": "2s", "park": "sleep"}),
    ]
    config = {
        "kubernetes": {"namespace": NS},
        "resources": {"memory_budget": "2GiB"},
        "queue": {"request_deadline": "20s"},
        "deployments": deps,
    }
    gw = await make_gateway(config, env={"KUBECONFIG": str(kubeconfig)})
    run = Run()
    watch(gw, run)
    runner, base = await management(gw)
    auth = {"Authorization": f"Bearer {gw.key}"}
    try:
        await play(gw, base, schedule(random.Random(SEED), steps, 1.0), run)
        lifecycle = gw.gateway.fleet.lifecycle
        with anyio.fail_after(30):
            for life in lifecycle.lives.values():
                await quiesce(life)
        assert run.broken == []
        print(summary(run))  # noqa: T201
        judge(run)
        for name in NAMES:  # status names the pod that runs, and only while one does
            state = lifecycle.lives[name].state
            live = [p for p in pods_of(api, name) if not p["metadata"].get("deletionTimestamp")]
            row = (deployment_status(gw.gateway.fleet, name) or {})["instances"][0]
            if state in ("ready", "parked"):
                assert [p["metadata"]["name"] for p in live] == [row["pod"]["name"]], (name, row)
                assert len(engines_running(served(name))) == 1
        async with httpx.AsyncClient(headers=auth, timeout=60) as m:
            for name in NAMES:
                assert (await m.post(f"{base}/deployments/{name}/stop")).status_code == 200
        for name in NAMES:
            assert pods_of(api, name) == []  # every stop returned once its pod was gone
            assert engines_running(served(name)) == []
            assert gw.gateway.fleet.settlement.ledgers[f"{name}/0"].cut == []
        assert lifecycle.budget.held() == 0
    finally:
        await runner.cleanup()
    assert run.broken == []
