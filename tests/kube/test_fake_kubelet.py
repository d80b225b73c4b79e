"""The fake scheduler and kubelet: pods bound by the default scheduler's rules (and its words
when nothing fits), containers run as real processes with their probes, exits, deletions,
evictions and lost nodes reported as a real kubelet and node controller would. Observed through
the real kubernetes_asyncio client (mostly by watch) and, for the processes, the OS."""

from __future__ import annotations

import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from tests.eventually import eventually
from tests.kube.apiserver import FakeApiServer
from tests.kube.conftest import (
    ENGINE,
    alive,
    condition,
    container_state,
    delete_pod,
    is_ready,
    pod,
    watch_pod,
)
from tests.kube.kubelet import FakeKubelet, FakeNode

pytestmark = pytest.mark.anyio
Obj = dict[str, Any]
NO_GPU = {"cpu": "16", "memory": "64Gi"}
SCALE = 0.05  # probe periods of 1 s are 50 ms here


@pytest.fixture
async def kubelet(api: FakeApiServer) -> AsyncIterator[FakeKubelet]:
    async with FakeKubelet(api, [FakeNode("node-a")], time_scale=SCALE) as k:
        yield k


def engine_pod(name: str, **spec: Any) -> Obj:
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1}
    container = {
        "command": [*ENGINE, "--host", "0.0.0.0", "--port", "8080", "--served", "m"],  # noqa: S104
        "args": ["--echo-env", "ADDR", "--peer=$(POD_IP)", "$$(POD_IP)", "$(UNKNOWN)"],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "ADDR", "value": "http://$(POD_IP):8080"},
        ],
        "ports": [{"name": "http", "containerPort": 8080}],
        "startupProbe": {**probe, "failureThreshold": 200},
        "readinessProbe": probe,
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
    }
    return pod(name, restartPolicy="Never", container=container, **spec)


async def test_an_engine_pod_runs_becomes_ready_serves_and_crashes(
    v1: Any, api: FakeApiServer, kubelet: FakeKubelet
) -> None:
    await v1.create_namespaced_pod("default", engine_pod("engine"))
    ready = await watch_pod(v1, "engine", lambda t, o: is_ready(o))
    status = ready["status"]
    ip = status["podIP"]  # 127.0.0.2 unless another test process holds its port 8080
    assert ip.startswith("127.0.0.") and ip != "127.0.0.1"
    assert (ready["spec"]["nodeName"], status["phase"], status["hostIP"]) == (
        "node-a",
        "Running",
        "127.0.0.1",
    )
    assert status["podIPs"] == [{"ip": ip}] and "startTime" in status
    cs = status["containerStatuses"][0]
    assert (cs["ready"], cs["started"], cs["restartCount"], cs["image"]) == (
        True,
        True,
        0,
        "vllm/vllm-openai:v0.31.0",
    )
    assert "startedAt" in cs["state"]["running"]
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "PodScheduled": "True", "Initialized": "True", "Ready": "True", "ContainersReady": "True", "PodReadyToStartContainers": "True"}  # fmt: skip
    async with aiohttp.ClientSession() as s, s.get(f"http://{ip}:8080/health") as r:
        assert r.status == 200  # the pod's own address: 0.0.0.0 became it
    pid = kubelet.processes["engine"]
    assert alive(pid)

    log = await v1.read_namespaced_pod_log("engine", "default")
    assert f"fake engine serving m on {ip}:8080" in log
    assert f"fake engine: loaded http://{ip}:8080" in log  # env expanded from an earlier var
    assert f"'--peer={ip}', '$(POD_IP)', '$(UNKNOWN)'" in log  # argv expansion, $$ escapes
    assert (
        await v1.read_namespaced_pod_log("engine", "default", tail_lines=1)
        == log.splitlines(keepends=True)[-1]
    )
    assert (
        await v1.read_namespaced_pod_log("engine", "default", container="engine", limit_bytes=11)
        == log[:11]
    )
    with pytest.raises(ApiException) as e:
        await v1.read_namespaced_pod_log("engine", "default", container="other")
    assert e.value.status == 400

    await kubelet.kill("engine", "default", signal.SIGKILL)
    failed = await watch_pod(v1, "engine", lambda t, o: o["status"]["phase"] == "Failed")
    term = container_state(failed)["terminated"]
    assert (term["exitCode"], term["reason"]) == (137, "Error") and "finishedAt" in term
    gone = condition(failed, "Ready")
    assert (gone["status"], gone["reason"]) == ("False", "PodFailed")
    assert not alive(pid) and "engine" not in kubelet.processes
    await eventually(lambda: kubelet.ips == {})  # the address is free again
    events = await v1.list_namespaced_event("default", field_selector="involvedObject.name=engine")
    assert {"Scheduled", "Started"} <= {e.reason for e in events.items}


async def test_graceful_delete_stops_the_process_then_removes_the_pod(
    v1: Any, kubelet: FakeKubelet
) -> None:
    body = engine_pod("engine")
    body["spec"]["containers"][0]["args"] = ["--ignore-sigterm"]  # lingers until SIGKILL
    await v1.create_namespaced_pod("default", body)
    await watch_pod(v1, "engine", lambda t, o: is_ready(o))
    pid = kubelet.processes["engine"]
    seen = await delete_pod(v1, "engine", grace_period_seconds=1)
    assert not alive(pid)
    kinds = [t for t, _ in seen]
    assert (
        kinds[0] == "MODIFIED"
        and "deletionTimestamp" in seen[0][1]["metadata"]
        and kinds[-1] == "DELETED"
    )
    last = seen[-2][1]  # the kubelet's last word: the container's end, SIGKILLed after the grace
    assert (
        last["status"]["phase"] == "Failed"
        and container_state(last)["terminated"]["exitCode"] == 137
    )
    assert "engine" not in kubelet.processes


async def test_unschedulable_pods_say_why_and_bind_once_a_node_fits(
    v1: Any, api: FakeApiServer
) -> None:
    nodes = [FakeNode("cpu-1", NO_GPU), FakeNode("cpu-2", NO_GPU)]
    async with FakeKubelet(api, nodes, time_scale=SCALE) as kubelet:
        await v1.create_namespaced_pod(
            "default", pod("gpu", container={"resources": {"limits": {"nvidia.com/gpu": "1"}}})
        )
        pending = await watch_pod(v1, "gpu", lambda t, o: bool(condition(o, "PodScheduled")))
        assert condition(pending, "PodScheduled") == {
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "lastProbeTime": None,
            "lastTransitionTime": condition(pending, "PodScheduled")["lastTransitionTime"],
            "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. preemption: 0/2 nodes are available: 2 No preemption victims found for incoming pod.",
        }  # fmt: skip
        events = await v1.list_namespaced_event("default", field_selector="involvedObject.name=gpu")
        (event,) = events.items
        assert (
            event.reason,
            event.type,
            event.involved_object.kind,
            event.involved_object.uid,
        ) == ("FailedScheduling", "Warning", "Pod", pending["metadata"]["uid"])
        kubelet.add_node(FakeNode("gpu-1"))
        running = await watch_pod(v1, "gpu", lambda t, o: o["status"].get("phase") == "Running")
        assert (
            running["spec"]["nodeName"] == "gpu-1"
            and condition(running, "PodScheduled")["status"] == "True"
        )
        await v1.create_namespaced_pod(
            "default", pod("second", container={"resources": {"limits": {"nvidia.com/gpu": "1"}}})
        )
        await watch_pod(v1, "second", lambda t, o: bool(condition(o, "PodScheduled")))
        await v1.delete_namespaced_pod("gpu", "default", grace_period_seconds=5)  # frees the GPU
        moved = await watch_pod(v1, "second", lambda t, o: o["status"].get("phase") == "Running")
        assert moved["spec"]["nodeName"] == "gpu-1"


async def test_selectors_taints_and_cordons_each_say_so(v1: Any, api: FakeApiServer) -> None:
    nodes = [
        FakeNode("tainted", taints=[{"key": "gpu", "value": "h200", "effect": "NoSchedule"}]),
        FakeNode("other-pool", labels={"pool": "b"}),
        FakeNode("cordoned", labels={"pool": "a"}),
    ]
    async with FakeKubelet(api, nodes, time_scale=SCALE) as kubelet:
        kubelet.cordon("cordoned")
        await v1.create_namespaced_pod("default", pod("p", nodeSelector={"pool": "a"}))
        pending = await watch_pod(v1, "p", lambda t, o: bool(condition(o, "PodScheduled")))
        assert condition(pending, "PodScheduled")["message"] == (
            "0/3 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, "
            "1 node(s) had untolerated taint {gpu: h200}, 1 node(s) were unschedulable. "
            "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
        )
        kubelet.uncordon("cordoned")
        bound = await watch_pod(v1, "p", lambda t, o: bool(o["spec"].get("nodeName")))
        assert bound["spec"]["nodeName"] == "cordoned"
        tolerant = pod("t", tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                       affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["tainted"]}]}]}}})  # fmt: skip
        await v1.create_namespaced_pod("default", tolerant)
        placed = await watch_pod(v1, "t", lambda t, o: bool(o["spec"].get("nodeName")))
        assert placed["spec"]["nodeName"] == "tainted"


async def test_eviction_fails_the_pod_and_keeps_it(v1: Any, kubelet: FakeKubelet) -> None:
    await v1.create_namespaced_pod("default", pod("p", restartPolicy="Never"))
    await watch_pod(v1, "p", lambda t, o: is_ready(o))
    pid = kubelet.processes["p"]
    await kubelet.evict("p", "default", message="The node was low on resource: memory.")
    got = (await v1.read_namespaced_pod("p", "default")).to_dict()
    status = got["status"]
    assert (status["phase"], status["reason"], status["message"]) == (
        "Failed",
        "Evicted",
        "The node was low on resource: memory.",
    )
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "False"
    assert (
        condition(await watch_pod(v1, "p", lambda t, o: True), "DisruptionTarget")["reason"]
        == "TerminationByKubelet"
    )
    assert status["container_statuses"][0]["state"]["terminated"]["exit_code"] == 137
    assert not alive(pid)
    await v1.delete_namespaced_pod("p", "default")  # a Failed pod goes at once
    with pytest.raises(ApiException):
        await v1.read_namespaced_pod("p", "default")


async def test_a_lost_node_leaves_its_pods_terminating_until_restored_or_forced(
    v1: Any, api: FakeApiServer, kubelet: FakeKubelet
) -> None:
    for name in ("a", "b"):
        await v1.create_namespaced_pod("default", pod(name))
        await watch_pod(v1, name, lambda t, o: is_ready(o))
    pids = dict(kubelet.processes)
    await kubelet.lose_node("node-a")
    for name in ("a", "b"):
        lost = (await v1.read_namespaced_pod(name, "default")).to_dict()
        assert lost["metadata"]["deletion_timestamp"] is not None  # Terminating
        ready = next(c for c in lost["status"]["conditions"] if c["type"] == "Ready")
        assert (ready["status"], ready["reason"], ready["message"]) == (
            "False",
            "NodeLost",
            "Kubelet stopped posting node status.",
        )
        assert not alive(pids[name])
    await v1.create_namespaced_pod("default", pod("c"))
    pending = await watch_pod(v1, "c", lambda t, o: bool(condition(o, "PodScheduled")))
    assert (
        "untolerated taint {node.kubernetes.io/unreachable: }"
        in condition(pending, "PodScheduled")["message"]
    )
    await v1.delete_namespaced_pod("a", "default", grace_period_seconds=0)  # forced
    assert ("default", "a") not in api.store.pods and ("default", "b") in api.store.pods
    await kubelet.restore_node("node-a")
    assert ("default", "b") not in api.store.pods
    await watch_pod(v1, "c", lambda t, o: is_ready(o))


async def test_probes_kill_a_container_that_stops_answering(v1: Any, kubelet: FakeKubelet) -> None:
    live = {"httpGet": {"path": "/health", "port": 8080}, "periodSeconds": 1, "failureThreshold": 2}
    await v1.create_namespaced_pod(
        "default", pod("p", restartPolicy="Never", container={"livenessProbe": live})
    )
    failed = await watch_pod(v1, "p", lambda t, o: o["status"].get("phase") == "Failed")
    term = container_state(failed)["terminated"]
    assert (term["exitCode"], term["reason"]) == (128 + signal.SIGTERM, "Error")
    events = await v1.list_namespaced_event(
        "default", field_selector="involvedObject.name=p,reason=Unhealthy"
    )
    url = f"http://{failed['status']['podIP']}:8080/health"
    assert events.items[0].message.startswith(f'Liveness probe failed: Get "{url}"')


async def test_restart_policy_always_restarts_in_place(v1: Any, kubelet: FakeKubelet) -> None:
    crash = [sys.executable, "-c", "print('run', flush=True); raise SystemExit(3)"]
    await v1.create_namespaced_pod("default", pod("p", crash))
    again = await watch_pod(
        v1,
        "p",
        lambda t, o: o["status"].get("containerStatuses", [{}])[0].get("restartCount", 0) >= 1,
    )
    cs = again["status"]["containerStatuses"][0]
    assert cs["lastState"]["terminated"]["exitCode"] == 3 and again["status"]["phase"] == "Running"
    assert await v1.read_namespaced_pod_log("p", "default", previous=True) == "run\n"
    await delete_pod(v1, "p", grace_period_seconds=5)


async def test_addresses_are_unique_and_freed_and_errors_show(
    v1: Any, kubelet: FakeKubelet
) -> None:
    for name in ("a", "b"):
        await v1.create_namespaced_pod("default", pod(name))
    ips = {
        n: (await watch_pod(v1, n, lambda t, o: is_ready(o)))["status"]["podIP"] for n in ("a", "b")
    }
    # 127.0.0.2 and .3 when no other test process runs pods: each address is leased machine-wide
    assert ips["a"] != ips["b"] and all(ip.startswith("127.0.0.") for ip in ips.values())
    held = set(kubelet.ips.values())
    await delete_pod(v1, "a", grace_period_seconds=5)
    assert set(kubelet.ips.values()) == held - {int(ips["a"].rsplit(".", 1)[1])}  # freed
    two = pod("two")
    two["spec"]["containers"].append({"name": "side", "image": "x", "command": ["true"]})
    await v1.create_namespaced_pod("default", two)
    stuck = await watch_pod(
        v1,
        "two",
        lambda t, o: (
            "waiting" in container_state(o)
            and container_state(o)["waiting"]["reason"] != "ContainerCreating"
        ),
    )
    assert container_state(stuck)["waiting"]["reason"] == "CreateContainerError"
    assert stuck["status"]["podIP"] != ips["b"]  # a's, unless another test process took it
    with pytest.raises(ApiException) as e:
        await v1.read_namespaced_pod_log("two", "default", container="engine")
    assert "is waiting to start: CreateContainerError" in str(e.value.body)
    seen = await delete_pod(v1, "two")
    assert [t for t, _ in seen] == ["MODIFIED", "DELETED"]  # never ran: removed at once


async def test_follow_streams_a_log_until_the_container_ends(
    v1: Any, api: FakeApiServer, kubelet: FakeKubelet, http: aiohttp.ClientSession
) -> None:
    talk = [
        sys.executable,
        "-c",
        "import time\nfor i in range(5):\n    print(i, flush=True); time.sleep(0.05)",
    ]
    await v1.create_namespaced_pod("default", pod("p", talk, restartPolicy="Never"))
    await watch_pod(
        v1, "p", lambda t, o: "running" in container_state(o) or "terminated" in container_state(o)
    )
    async with http.get("/api/v1/namespaces/default/pods/p/log", params={"follow": "true"}) as r:
        assert await r.text() == "0\n1\n2\n3\n4\n"
    done = await watch_pod(v1, "p", lambda t, o: o["status"].get("phase") == "Succeeded")
    assert container_state(done)["terminated"]["reason"] == "Completed"
    assert await v1.read_namespaced_pod_log("p", "default", tail_lines=2, limit_bytes=3) == "3\n4"


async def test_a_forced_delete_removes_at_once_and_the_kubelet_kills_the_orphan(
    v1: Any, api: FakeApiServer, kubelet: FakeKubelet
) -> None:
    await v1.create_namespaced_pod("default", pod("p"))
    await watch_pod(v1, "p", lambda t, o: is_ready(o))
    pid = kubelet.processes["p"]
    gone = await v1.delete_namespaced_pod("p", "default", grace_period_seconds=0)
    assert gone.metadata.name == "p" and ("default", "p") not in api.store.pods  # no waiting
    await eventually(
        lambda: not alive(pid)
    )  # as the real kubelet: it kills what it no longer knows
