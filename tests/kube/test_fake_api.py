"""The fake API server answers as the real one does, through the real kubernetes_asyncio client
(CoreV1Api, raw ``_preload_content=False`` responses) and raw aiohttp: create with the server's
fields and defaults, get, list with selectors, the error Statuses, graceful deletion and its
preconditions, the status subresource, faults on demand. Watches: test_fake_watch.py."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from tests.kube.apiserver import FakeApiServer
from tests.kube.conftest import pod
from tests.kube.selectors import LabelSelector, SelectorError

pytestmark = pytest.mark.anyio
Obj = dict[str, Any]


def status_of(e: ApiException) -> Obj:
    body: Obj = json.loads(e.body or "{}")
    return body


async def test_create_returns_the_stored_pod_with_server_fields_and_defaults(
    v1: Any, api: FakeApiServer
) -> None:
    body = pod("web")
    body["spec"]["containers"][0]["readinessProbe"] = {"httpGet": {"path": "/health", "port": 8080}}
    body["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1", "memory": "1Gi"}}
    created = await v1.create_namespaced_pod("default", body)
    assert created.metadata.uid and created.metadata.creation_timestamp is not None
    assert created.metadata.namespace == "default" and created.metadata.generation == 1
    assert created.metadata.resource_version == str(api.store.rv)
    spec = created.spec
    assert (spec.restart_policy, spec.termination_grace_period_seconds, spec.dns_policy, spec.scheduler_name) == (
        "Always", 30, "ClusterFirst", "default-scheduler")  # fmt: skip
    c = spec.containers[0]
    assert (c.termination_message_path, c.image_pull_policy) == (
        "/dev/termination-log",
        "IfNotPresent",
    )
    probe = c.readiness_probe
    assert (
        probe.period_seconds,
        probe.timeout_seconds,
        probe.success_threshold,
        probe.failure_threshold,
    ) == (10, 1, 1, 3)
    assert c.resources.requests == {"cpu": "1", "memory": "1Gi"}  # defaulted from limits
    assert (created.status.phase, created.status.qos_class) == ("Pending", "Guaranteed")
    got = await v1.read_namespaced_pod("web", "default")
    assert (
        got.metadata.uid == created.metadata.uid
        and got.metadata.resource_version == created.metadata.resource_version
    )

    burstable = pod("b")
    burstable["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "500m"}}
    assert (await v1.create_namespaced_pod("default", burstable)).status.qos_class == "Burstable"
    assert (await v1.create_namespaced_pod("default", pod("e"))).status.qos_class == "BestEffort"


async def test_every_write_bumps_one_global_resource_version(v1: Any, api: FakeApiServer) -> None:
    a = await v1.create_namespaced_pod("default", pod("a"))
    b = await v1.create_namespaced_pod("other", pod("b"))
    assert int(b.metadata.resource_version) == int(a.metadata.resource_version) + 1
    listed = await v1.list_pod_for_all_namespaces()
    assert listed.metadata.resource_version == b.metadata.resource_version
    same = await v1.patch_namespaced_pod_status("a", "default", {"status": {"phase": "Pending"}})
    assert same.metadata.resource_version == a.metadata.resource_version  # no change, no write


async def test_generate_name_gets_five_characters(v1: Any) -> None:
    body = pod("")
    body["metadata"] = {"generateName": "engine-"}
    created = await v1.create_namespaced_pod("default", body)
    name = created.metadata.name
    assert name.startswith("engine-") and len(name) == len("engine-") + 5 and name[7:].isalnum()


async def test_refusals_carry_the_real_status_bodies(
    v1: Any, api: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    await v1.create_namespaced_pod("default", pod("web"))
    with pytest.raises(ApiException) as e:
        await v1.create_namespaced_pod("default", pod("web"))
    assert e.value.status == 409
    assert status_of(e.value) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'pods "web" already exists', "reason": "AlreadyExists", "code": 409,
        "details": {"name": "web", "kind": "pods"},
    }  # fmt: skip

    unknown = pod("x")
    unknown["spec"]["containers"][0]["bogus"] = 1
    with pytest.raises(ApiException) as e:
        await v1.create_namespaced_pod("default", unknown)
    body = status_of(e.value)
    assert (e.value.status, body["reason"], body["details"]["kind"]) == (422, "Invalid", "pods")
    assert body["details"]["causes"][0]["field"] == "spec.containers[0].bogus"

    no_image = pod("y")
    del no_image["spec"]["containers"][0]["image"]
    with pytest.raises(ApiException) as e:
        await v1.create_namespaced_pod("default", no_image)
    body = status_of(e.value)
    assert body["message"] == 'Pod "y" is invalid: spec.containers[0].image: Required value'
    assert body["details"]["causes"] == [
        {
            "reason": "FieldValueRequired",
            "message": "Required value",
            "field": "spec.containers[0].image",
        }
    ]

    nameless = pod("")
    with pytest.raises(ApiException) as e:
        await v1.create_namespaced_pod("default", nameless)
    assert (
        e.value.status == 422
        and "name or generateName is required" in status_of(e.value)["message"]
    )

    elsewhere = pod("z")
    elsewhere["metadata"]["namespace"] = "other"
    with pytest.raises(ApiException) as e:
        await v1.create_namespaced_pod("default", elsewhere)
    assert e.value.status == 400  # as the real server: BadRequest, not Invalid

    with pytest.raises(ApiException) as e:
        await v1.read_namespaced_pod("nope", "default")
    assert (e.value.status, status_of(e.value)["message"]) == (404, 'pods "nope" not found')
    with pytest.raises(ApiException) as e:
        await v1.delete_namespaced_pod("nope", "default")
    assert e.value.status == 404

    async with http.get("/api/v1/namespaces/default/services") as r:
        assert (r.status, (await r.json())["reason"]) == (404, "NotFound")
    async with aiohttp.ClientSession() as anonymous, anonymous.get(api.url + "/api/v1/pods") as r:
        assert (r.status, (await r.json())["reason"]) == (401, "Unauthorized")
    assert len(api.store.pods) == 1


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("app=web", {"w1", "w2"}),
        ("app==web,tier=gpu", {"w2"}),
        ("app!=web", {"db", "bare"}),
        ("tier", {"w2", "db"}),
        ("!tier", {"w1", "bare"}),
        ("app in (web, db)", {"w1", "w2", "db"}),
        ("app notin (web),tier", {"db"}),
        ("", {"w1", "w2", "db", "bare"}),
    ],
)
async def test_list_filters_by_label_selector(v1: Any, selector: str, expected: set[str]) -> None:
    for name, labels in (
        ("w1", {"app": "web"}),
        ("w2", {"app": "web", "tier": "gpu"}),
        ("db", {"app": "db", "tier": "x"}),
        ("bare", None),
    ):
        await v1.create_namespaced_pod("default", pod(name, labels=labels))
    listed = await v1.list_namespaced_pod("default", label_selector=selector, limit=10)
    assert {p.metadata.name for p in listed.items} == expected


async def test_list_field_selectors_namespaces_and_bad_selectors(
    v1: Any, http: aiohttp.ClientSession
) -> None:
    await v1.create_namespaced_pod("default", pod("a"))
    await v1.create_namespaced_pod("other", pod("a"))
    await v1.create_namespaced_pod("other", pod("b"))
    assert len((await v1.list_pod_for_all_namespaces()).items) == 3
    assert [
        p.metadata.namespace
        for p in (await v1.list_pod_for_all_namespaces(field_selector="metadata.name=a")).items
    ] == ["default", "other"]
    only = await v1.list_pod_for_all_namespaces(
        field_selector="metadata.namespace=other,metadata.name!=a"
    )
    assert [p.metadata.name for p in only.items] == ["b"]
    async with http.get("/api/v1/namespaces/other/pods") as r:
        raw = await r.json()
    assert (
        raw["kind"] == "PodList"
        and raw["metadata"]["resourceVersion"].isdigit()
        and len(raw["items"]) == 2
    )
    for bad in (
        {"labelSelector": "app in (web"},
        {"labelSelector": "a=b=c"},
        {"fieldSelector": "spec.image=x"},
    ):
        async with http.get("/api/v1/pods", params=bad) as r:
            assert (r.status, (await r.json())["reason"]) == (400, "BadRequest"), bad


@pytest.mark.parametrize(
    "text", ["a in ()", "a b", "=x", "a=b,", "!", "a notin x", "a=in valid!", "Bad_/key=x", "a>x"]
)
def test_malformed_label_selectors_are_refused(text: str) -> None:
    with pytest.raises(SelectorError):
        LabelSelector.parse(text)


def test_label_selector_edge_semantics() -> None:
    assert LabelSelector.parse("a notin (x)").matches({})  # absent is "not in"
    assert not LabelSelector.parse("a in (x)").matches({})
    assert LabelSelector.parse("a!=x").matches({"b": "x"})
    assert LabelSelector.parse("example.com/a=1, b>2").matches({"example.com/a": "1", "b": "3"})


async def test_graceful_delete_of_a_bound_pod_and_its_preconditions(
    v1: Any, api: FakeApiServer
) -> None:
    bound = pod("a", nodeName="node-x")  # bound by hand; no kubelet here to finish it
    created = await v1.create_namespaced_pod("default", bound)
    with pytest.raises(ApiException) as e:
        await v1.delete_namespaced_pod(
            "a",
            "default",
            body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="other")),
        )
    assert (e.value.status, status_of(e.value)["reason"]) == (409, "Conflict")
    first = await v1.delete_namespaced_pod(
        "a",
        "default",
        body={
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "preconditions": {"uid": created.metadata.uid},
        },
    )
    assert (
        first.metadata.deletion_timestamp is not None
        and first.metadata.deletion_grace_period_seconds == 30
    )
    assert first.metadata.generation == 2
    longer = await v1.delete_namespaced_pod("a", "default", grace_period_seconds=60)
    assert (
        longer.metadata.deletion_grace_period_seconds == 30
        and longer.metadata.resource_version == first.metadata.resource_version
    )
    shorter = await v1.delete_namespaced_pod("a", "default", grace_period_seconds=5)
    assert (
        shorter.metadata.deletion_grace_period_seconds == 5
        and shorter.metadata.deletion_timestamp < first.metadata.deletion_timestamp
    )
    assert (
        await v1.read_namespaced_pod("a", "default")
    ).metadata.deletion_timestamp is not None  # still there
    await v1.delete_namespaced_pod("a", "default", grace_period_seconds=0)  # forced
    assert ("default", "a") not in api.store.pods
    await v1.create_namespaced_pod("default", pod("unbound"))
    await v1.delete_namespaced_pod("unbound", "default", grace_period_seconds=30)
    assert ("default", "unbound") not in api.store.pods  # never scheduled: gone at once


async def test_status_subresource_writes_status_only(
    v1: Any, api: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    created = await v1.create_namespaced_pod("default", pod("a", labels={"app": "x"}))
    patched = await v1.patch_namespaced_pod_status(
        "a",
        "default",
        {
            "metadata": {"labels": {"app": "y"}},
            "status": {"conditions": [{"type": "Ready", "status": "False"}]},
        },
    )
    assert patched.metadata.labels == {"app": "x"} and patched.status.conditions[0].type == "Ready"
    merge = {"status": {"conditions": [{"type": "PodScheduled", "status": "True"}]}}
    async with http.patch(
        "/api/v1/namespaces/default/pods/a/status",
        json=merge,
        headers={"Content-Type": "application/strategic-merge-patch+json"},
    ) as r:
        assert r.status == 200
        assert [c["type"] for c in (await r.json())["status"]["conditions"]] == [
            "Ready",
            "PodScheduled",
        ]  # merged by type
    async with http.patch(
        "/api/v1/namespaces/default/pods/a/status",
        json=merge,
        headers={"Content-Type": "application/merge-patch+json"},
    ) as r:
        assert [c["type"] for c in (await r.json())["status"]["conditions"]] == [
            "PodScheduled"
        ]  # replaced
    with pytest.raises(ApiException) as e:
        await v1.replace_namespaced_pod_status(
            "a",
            "default",
            {
                "metadata": {"name": "a", "resourceVersion": created.metadata.resource_version},
                "status": {"phase": "Running"},
            },
        )
    assert (e.value.status, status_of(e.value)["reason"]) == (409, "Conflict")
    current = await v1.read_namespaced_pod_status("a", "default")
    current.status.phase = "Running"
    replaced = await v1.replace_namespaced_pod_status("a", "default", current)
    assert replaced.status.phase == "Running" and replaced.spec.containers[0].name == "engine"
    with pytest.raises(ApiException) as e:
        await v1.patch_namespaced_pod("a", "default", {"spec": {"restartPolicy": "Never"}})
    assert e.value.status == 422


async def test_faults_on_demand_and_the_call_record(v1: Any, api: FakeApiServer) -> None:
    await v1.create_namespaced_pod("default", pod("a"))
    api.fail_next("GET", "/pods/a", 503, times=2)
    for _ in range(2):
        with pytest.raises(ApiException) as e:
            await v1.read_namespaced_pod("a", "default")
        assert (e.value.status, status_of(e.value)["reason"]) == (503, "ServiceUnavailable")
    assert (await v1.read_namespaced_pod("a", "default")).metadata.name == "a"
    api.fail_next("POST", "/pods", 429)
    with pytest.raises(ApiException) as e:
        await v1.create_namespaced_pod("default", pod("b"))
    assert (
        e.value.status == 429
        and e.value.headers is not None
        and e.value.headers["Retry-After"] == "1"
    )
    gets = [c for c in api.calls if c[0] == "GET" and c[1] == "/api/v1/namespaces/default/pods/a"]
    assert len(gets) == 3
    raw = await v1.read_namespaced_pod("a", "default", _preload_content=False)
    async with raw:
        assert json.loads(await raw.read())["kind"] == "Pod"


async def test_a_lost_answer_is_carried_out_and_its_connection_cut(
    v1: Any, api: FakeApiServer
) -> None:
    api.lose_next("POST", "/pods")
    with pytest.raises(aiohttp.ClientError):  # no answer: the connection ends before it
        await v1.create_namespaced_pod("default", pod("a"))
    assert (await v1.read_namespaced_pod("a", "default")).metadata.name == "a"  # made all the same
    with pytest.raises(ApiException) as e:  # the same create again finds it
        await v1.create_namespaced_pod("default", pod("a"))
    assert (e.value.status, status_of(e.value)["reason"]) == (409, "AlreadyExists")
    api.fail_next("DELETE", "/pods/a", 500, times=5)
    api.clear_faults()
    await v1.delete_namespaced_pod("a", "default")  # the faults forgotten: it is carried out


async def test_log_route_before_anything_ran(v1: Any) -> None:
    await v1.create_namespaced_pod("default", pod("a"))
    with pytest.raises(ApiException) as e:
        await v1.read_namespaced_pod_log("a", "default")
    assert (e.value.status, status_of(e.value)["message"]) == (
        400,
        'container "engine" in pod "a" is waiting to start: ContainerCreating',
    )
    with pytest.raises(ApiException) as e:
        await v1.read_namespaced_pod_log("nope", "default")
    assert e.value.status == 404
