"""The fake API server's watches, through the real kubernetes_asyncio Watch and raw aiohttp:
replay from a resourceVersion then live events, selectors (an object leaving one is DELETED),
410 Expired after compaction in both forms, bookmarks, server-side timeouts, dropped streams."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import anyio
import pytest
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from tests.eventually import eventually
from tests.kube.apiserver import FakeApiServer
from tests.kube.conftest import pod

pytestmark = pytest.mark.anyio


async def test_watch_replays_from_a_resource_version_then_goes_live(
    v1: Any, api: FakeApiServer
) -> None:
    start = (await v1.list_namespaced_pod("default")).metadata.resource_version
    await v1.create_namespaced_pod("default", pod("a", labels={"app": "web"}))
    await v1.create_namespaced_pod("default", pod("other", labels={"app": "db"}))
    await v1.patch_namespaced_pod_status("a", "default", {"status": {"message": "hello"}})
    await v1.patch_namespaced_pod(
        "a", "default", {"metadata": {"labels": {"app": "gone"}}}
    )  # leaves the selector
    api.bookmark_interval = 60  # only the bookmark asked for below
    seen: list[tuple[str, str, str]] = []
    async with watch.Watch() as w:
        with anyio.fail_after(10):
            stream = w.stream(
                v1.list_namespaced_pod,
                "default",
                label_selector="app=web",
                resource_version=start,
                allow_watch_bookmarks=True,
            )
            async for ev in stream:
                obj = ev["raw_object"]
                seen.append(
                    (
                        ev["type"],
                        obj["metadata"].get("name", ""),
                        obj["metadata"]["resourceVersion"],
                    )
                )
                if ev["type"] == "DELETED":
                    await v1.patch_namespaced_pod(
                        "a", "default", {"metadata": {"labels": {"app": "web"}}}
                    )  # back in
                elif len(seen) == 4:
                    api.bookmark()
                elif ev["type"] == "BOOKMARK":
                    break
    assert [(t, n) for t, n, _ in seen] == [
        ("ADDED", "a"),
        ("MODIFIED", "a"),
        ("DELETED", "a"),
        ("ADDED", "a"),
        ("BOOKMARK", ""),
    ]
    rvs = [int(rv) for _, _, rv in seen]
    assert rvs == sorted(rvs) and rvs[-1] == api.store.rv
    resumes_at: Any = w.resource_version  # where the client would resume
    assert resumes_at == str(api.store.rv)


async def test_watch_from_now_lists_current_pods_and_sees_deletes(
    v1: Any, api: FakeApiServer
) -> None:
    await v1.create_namespaced_pod("default", pod("old"))
    events: list[tuple[str, Any]] = []
    async with watch.Watch() as w:
        with anyio.fail_after(10):
            async for ev in w.stream(v1.list_namespaced_pod, "default", resource_version="0"):
                events.append((ev["type"], ev["object"]))
                if len(events) == 1:
                    await v1.create_namespaced_pod("default", pod("new"))
                elif len(events) == 2:
                    await v1.delete_namespaced_pod("new", "default")
                else:
                    break
    assert [(t, o.metadata.name) for t, o in events] == [
        ("ADDED", "old"),
        ("ADDED", "new"),
        ("DELETED", "new"),
    ]
    assert isinstance(events[0][1], client.V1Pod)
    assert int(events[2][1].metadata.resource_version) == api.store.rv  # its own RV, bumped


@pytest.mark.parametrize("as_http", [False, True])
async def test_a_watch_from_before_compaction_is_expired(
    v1: Any, api: FakeApiServer, http: aiohttp.ClientSession, as_http: bool
) -> None:
    first = await v1.create_namespaced_pod("default", pod("a"))
    await v1.create_namespaced_pod("default", pod("b"))
    api.compact()
    api.expired_as_http_410 = as_http
    old = first.metadata.resource_version
    async with http.get(
        "/api/v1/namespaces/default/pods", params={"watch": "true", "resourceVersion": old}
    ) as r:
        if as_http:
            assert r.status == 410
            lines = [await r.read()]
        else:
            assert r.status == 200
            lines = [line async for line in r.content]
    assert len(lines) == 1
    got = json.loads(lines[0])
    gone = got if as_http else got["object"]
    assert as_http or got["type"] == "ERROR"
    assert (gone["kind"], gone["code"], gone["reason"]) == ("Status", 410, "Expired")
    assert gone["message"] == f"too old resource version: {old} ({api.store.rv})"
    async with watch.Watch() as w:
        with pytest.raises(ApiException) as e, anyio.fail_after(10):
            async for _ in w.stream(
                v1.list_namespaced_pod, "default", resource_version=old, timeout_seconds=5
            ):
                pass
    assert e.value.status == 410
    resumed = await http.get(
        "/api/v1/namespaces/default/pods",
        params={"watch": "1", "resourceVersion": str(api.store.rv), "timeoutSeconds": "1"},
    )
    async with resumed:
        assert resumed.status == 200 and await resumed.read() == b""  # from the floor on: fine


async def test_bookmarks_only_when_allowed_and_periodic(
    api: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    api.bookmark_interval = 0.05
    path = "/api/v1/namespaces/default/pods"
    async with http.get(path, params={"watch": "true", "resourceVersion": "0"}) as plain:
        await eventually(lambda: api.open_watches == 1)
        api.bookmark()
        api.store.create_pod("default", pod("a"))
        assert (
            json.loads(await plain.content.readline())["type"] == "ADDED"
        )  # no bookmark came first
    async with http.get(path, params={"watch": "true", "allowWatchBookmarks": "true"}) as marked:
        for _ in range(3):
            event = json.loads(await marked.content.readline())
            if event["type"] == "BOOKMARK":
                break
    assert event["object"] == {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": str(api.store.rv)},
    }


async def test_timeout_ends_a_watch_cleanly_and_a_drop_does_not(
    api: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    api.store.create_pod("default", pod("a"))
    path = "/api/v1/namespaces/default/pods"
    with anyio.fail_after(5):
        async with http.get(path, params={"watch": "true", "timeoutSeconds": "1"}) as r:
            lines = [line async for line in r.content]  # the end of the chunked body: a clean end
    assert [json.loads(line)["type"] for line in lines] == ["ADDED"]
    async with http.get(path, params={"watch": "true"}) as r:
        assert json.loads(await r.content.readline())["type"] == "ADDED"
        await eventually(lambda: api.open_watches == 1)
        api.drop_watches()
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.content.readline()
    await eventually(lambda: api.open_watches == 0)


async def test_the_client_watch_raises_on_a_dropped_watch(v1: Any, api: FakeApiServer) -> None:
    """kubernetes_asyncio's Watch does not reconnect after a cut: a runner must."""
    api.store.create_pod("default", pod("a"))
    async with watch.Watch() as w:
        with pytest.raises(aiohttp.ClientPayloadError), anyio.fail_after(10):
            async for ev in w.stream(v1.list_namespaced_pod, "default"):
                assert ev["type"] == "ADDED"
                api.drop_watches()


async def test_server_shutdown_ends_open_watches_cleanly() -> None:
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer fake-token"}) as s:
        async with FakeApiServer() as server:
            r = await s.get(server.url + "/api/v1/pods?watch=true")
            await eventually(lambda: server.open_watches == 1)
        with anyio.fail_after(5):
            assert await r.read() == b""
        r.release()
