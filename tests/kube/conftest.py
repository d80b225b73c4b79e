"""Fixtures for the fake Kubernetes' own tests: the API server, a real kubernetes_asyncio client
configured from the kubeconfig it writes, raw aiohttp to it, and waiting on a pod by watch."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from kubernetes_asyncio import client, config, watch

from tests.kube.apiserver import FakeApiServer

Obj = dict[str, Any]
TOKEN = "s3cret-token"
ENGINE = [sys.executable, "-m", "tests.gateway.launchable_engine"]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer(token=TOKEN) as server:
        yield server


@pytest.fixture
async def v1(api: FakeApiServer, tmp_path: Path) -> AsyncIterator[Any]:
    """A CoreV1Api of the real client, configured by load_kube_config from api.kubeconfig."""
    cfg = client.Configuration()
    path = api.kubeconfig(tmp_path / "kubeconfig")
    await config.load_kube_config(config_file=str(path), client_configuration=cfg)
    async with client.ApiClient(cfg) as c:
        yield client.CoreV1Api(c)


@pytest.fixture
async def http(api: FakeApiServer) -> AsyncIterator[aiohttp.ClientSession]:
    """Raw aiohttp to the API server, with the token."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(api.url, headers=headers) as session:
        yield session


def pod(name: str, command: list[str] | None = None, **spec: Any) -> Obj:
    """A one-container Pod body; ``labels`` and ``container`` (merged in) are taken from spec."""
    labels = spec.pop("labels", None)
    container = {
        "name": "engine",
        "image": "vllm/vllm-openai:v0.31.0",
        "command": command or SLEEPER,
    }
    container.update(spec.pop("container", {}))
    meta: Obj = {"name": name, **({"labels": labels} if labels else {})}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [container], **spec},
    }


async def watch_pod(
    v1: Any,
    name: str,
    until: Callable[[str, Obj], bool],
    *,
    since: str | None = None,
    within: float = 20,
) -> Obj:
    """Follow pod ``name`` (in "default") with the client's Watch until ``until(type, object)``;
    that object. The watch starts with the pod's current state (or, given ``since``, with the
    changes after that resourceVersion), so nothing is missed."""
    more = {} if since is None else {"resource_version": since}
    selector = f"metadata.name={name}"
    with anyio.fail_after(within):
        async with watch.Watch() as w:
            async for ev in w.stream(
                v1.list_namespaced_pod, "default", field_selector=selector, **more
            ):
                if until(ev["type"], ev["raw_object"]):
                    found: Obj = ev["raw_object"]
                    return found
    raise AssertionError("the watch ended")


def condition(obj: Obj, kind: str) -> Obj:
    """The pod's condition of that type; {} if it has none."""
    found: Obj = next((c for c in obj["status"].get("conditions") or [] if c["type"] == kind), {})
    return found


def is_ready(obj: Obj) -> bool:
    return condition(obj, "Ready").get("status") == "True"


def container_state(obj: Obj) -> Obj:
    statuses = obj["status"].get("containerStatuses") or [{"state": {}}]
    state: Obj = statuses[0]["state"]
    return state


async def delete_pod(v1: Any, name: str, **options: Any) -> list[tuple[str, Obj]]:
    """Delete pod ``name`` and follow it until it is gone; the events seen from the delete on
    (watched from the resourceVersion before it, so a removal at once is not missed)."""
    before = (await v1.read_namespaced_pod(name, "default")).metadata.resource_version
    await v1.delete_namespaced_pod(name, "default", **options)
    seen: list[tuple[str, Obj]] = []

    def record(kind: str, obj: Obj) -> bool:
        seen.append((kind, obj))
        return kind == "DELETED"

    await watch_pod(v1, name, record, since=before)
    return seen


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts: not yet collected)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
