"""The few Kubernetes API calls the pod runner makes, over `kubernetes_asyncio` (its kubeconfig
and in-cluster credentials, its aiohttp session), with objects kept as plain JSON.

Every reply is read within a bound (`MAX_REPLY_BYTES`; one watch event: `MAX_EVENT_BYTES`), every
call has a timeout, and each call is counted by verb (``calls``: what a start or a stop costs the
API server). An error names the API server's reason and message, never its address.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from .._config import Kubernetes
from .._errors import OperatorError

__all__ = [
    "MAX_EVENT_BYTES",
    "MAX_REPLY_BYTES",
    "CALL_TIMEOUT_S",
    "ExpiredError",
    "KubeApi",
    "KubeError",
    "connect",
]

logger = logging.getLogger("capyctl_gateway")

MAX_REPLY_BYTES = 16 * 2**20
"""The most one reply (a list of the gateway's pods, a log excerpt) may hold."""
MAX_EVENT_BYTES = 4 * 2**20
"""The most one watch event may hold (a pod is a few KiB)."""
CALL_TIMEOUT_S = 15.0
"""Connect and read timeout of every call but a watch's read."""
WATCH_GRACE_S = 30.0
"""A watch's read waits this much past the time the API server was asked to end it."""


class KubeError(Exception):
    """The API server refused a call (``status``: its HTTP status, 0 when it could not be
    reached; ``reason``: its Status reason, such as ``AlreadyExists``)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}" if message else reason)
        self.status, self.reason, self.message = status, reason, message


class ExpiredError(KubeError):
    """A watch asked for a resourceVersion the API server no longer has (410 Gone)."""


def _status_error(status: int, body: bytes) -> KubeError:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = {}
    doc = doc if isinstance(doc, dict) else {}
    reason = str(doc.get("reason") or f"HTTP {status}")
    message = str(doc.get("message") or "")[:1000]
    code = doc.get("code", status)
    return (ExpiredError if code == 410 or status == 410 else KubeError)(status, reason, message)


async def _read(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    body = bytearray()
    async for part in resp.content.iter_chunked(65536):
        body += part
        if len(body) > limit:
            raise KubeError(resp.status, "TooLarge", f"a reply over {limit} bytes")
    return bytes(body)


class KubeApi:
    """One cluster's API, as the pod runner calls it."""

    def __init__(self, client: Any) -> None:
        from kubernetes_asyncio import client as k8s  # imported only where pods run

        self._client = client
        self._core: Any = k8s.CoreV1Api(client)  # its stubs want its models; raw JSON here
        self.calls: Counter[str] = Counter()
        """verb (create, get, delete, list, watch, log) -> calls made."""

    async def close(self) -> None:
        await self._client.close()

    async def _call(self, verb: str, call: Awaitable[Any], limit: int | None = None) -> bytes:
        self.calls[verb] += 1
        try:
            resp: aiohttp.ClientResponse = await call
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            logger.warning("the Kubernetes API could not be reached (%s): %s", verb, exc)
            raise KubeError(0, "Unreachable", "the Kubernetes API could not be reached") from None
        try:
            body = await _read(resp, limit or MAX_REPLY_BYTES)
        except (aiohttp.ClientError, TimeoutError, OSError):
            raise KubeError(0, "Unreachable", "the Kubernetes API's reply was cut") from None
        finally:
            resp.release()
        if resp.status >= 300:
            raise _status_error(resp.status, body)
        return body

    async def create(self, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
        call = self._core.create_namespaced_pod(
            namespace, pod, _preload_content=False, _request_timeout=CALL_TIMEOUT_S
        )
        return _object(await self._call("create", call))

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod ``name``; None when it is not there."""
        call = self._core.read_namespaced_pod(
            name, namespace, _preload_content=False, _request_timeout=CALL_TIMEOUT_S
        )
        return await _unless_absent(self._call("get", call))

    async def delete(
        self, namespace: str, name: str, grace_s: int, uid: str | None = None
    ) -> dict[str, Any] | None:
        """Delete the pod ``name`` (only if its uid is ``uid``); None when it is not there."""
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
        body["gracePeriodSeconds"] = grace_s
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        call = self._core.delete_namespaced_pod(
            name, namespace, body=body, _preload_content=False, _request_timeout=CALL_TIMEOUT_S
        )
        return await _unless_absent(self._call("delete", call))

    async def list(self, namespace: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        """The pods ``selector`` matches, and the resourceVersion the list was taken at."""
        call = self._core.list_namespaced_pod(
            namespace,
            label_selector=selector,
            _preload_content=False,
            _request_timeout=CALL_TIMEOUT_S,
        )
        doc = _object(await self._call("list", call))
        items = doc.get("items") or []
        rv = str((doc.get("metadata") or {}).get("resourceVersion") or "")
        return [i for i in items if isinstance(i, dict)], rv

    async def watch(
        self, namespace: str, selector: str, rv: str, timeout_s: float
    ) -> AsyncGenerator[tuple[str, dict[str, Any]]]:
        """The pods' changes after ``rv`` as (type, object), bookmarks included, until the API
        server ends the watch (after ``timeout_s``). Raises ExpiredError (410: list again),
        KubeError."""
        self.calls["watch"] += 1
        timeout = aiohttp.ClientTimeout(
            sock_connect=CALL_TIMEOUT_S, sock_read=timeout_s + WATCH_GRACE_S
        )
        try:
            resp: aiohttp.ClientResponse = await self._core.list_namespaced_pod(
                namespace,
                label_selector=selector,
                resource_version=rv,
                allow_watch_bookmarks=True,
                timeout_seconds=int(timeout_s),
                watch=True,
                _preload_content=False,
                _request_timeout=timeout,
            )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            logger.warning("the Kubernetes API could not be reached (watch): %s", exc)
            raise KubeError(0, "Unreachable", "the Kubernetes API could not be reached") from None
        try:
            if resp.status >= 300:
                raise _status_error(resp.status, await _read(resp, MAX_EVENT_BYTES))
            async for line in _lines(resp):
                event = orjson.loads(line)
                kind, obj = event.get("type"), event.get("object")
                if not isinstance(obj, dict) or not isinstance(kind, str):
                    raise KubeError(resp.status, "BadEvent", "a watch event without its object")
                if kind == "ERROR":
                    raise _status_error(int(obj.get("code") or 500), line)
                yield kind, obj
        except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as exc:
            raise KubeError(0, "Cut", f"the watch ended early: {type(exc).__name__}") from None
        finally:
            resp.release()

    async def log(self, namespace: str, name: str, lines: int, max_bytes: int) -> str:
        call = self._core.read_namespaced_pod_log(
            name,
            namespace,
            tail_lines=lines,
            limit_bytes=max_bytes,
            _preload_content=False,
            _request_timeout=CALL_TIMEOUT_S,
        )
        return (await self._call("log", call, limit=max_bytes + 65536)).decode(errors="replace")


async def _unless_absent(reply: Awaitable[bytes]) -> dict[str, Any] | None:
    """The object ``reply`` holds; None when the API server answered 404."""
    try:
        return _object(await reply)
    except KubeError as exc:
        if exc.status == 404:
            return None
        raise


def _object(body: bytes) -> dict[str, Any]:
    doc = orjson.loads(body)
    if not isinstance(doc, dict):
        raise KubeError(200, "BadReply", "the API server's reply is not an object")
    return doc


async def _lines(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The watch's events, one JSON document per line, each within `MAX_EVENT_BYTES`."""
    buf = bytearray()
    async for part in resp.content.iter_any():
        buf += part
        while (end := buf.find(b"\n")) >= 0:
            _within(end, resp.status)  # a whole line, as one that is still coming
            line = bytes(buf[:end]).strip()
            del buf[: end + 1]
            if line:
                yield line
        _within(len(buf), resp.status)
    if buf.strip():
        yield bytes(buf).strip()


def _within(size: int, status: int) -> None:
    if size > MAX_EVENT_BYTES:
        raise KubeError(status, "TooLarge", f"a watch event over {MAX_EVENT_BYTES} bytes")


async def connect(kube: Kubernetes, env: Mapping[str, str]) -> KubeApi:
    """The API of the cluster ``kube`` names, with the credentials found as kubectl finds
    them: ``kubernetes.kubeconfig``, else ``KUBECONFIG``, else ``~/.kube/config``, else the
    service account of the pod the gateway runs in. Raises OperatorError when there are none."""
    from kubernetes_asyncio import client as k8s
    from kubernetes_asyncio import config as k8s_config

    cfg = k8s.Configuration()
    path = kube.kubeconfig or env.get("KUBECONFIG") or _default_kubeconfig(env)
    if path and not _any_file(str(path)):
        raise OperatorError(f"the kubeconfig {path} cannot be read: no such file")
    try:
        if path:
            await k8s_config.load_kube_config(
                config_file=str(path),
                context=kube.context,
                client_configuration=cfg,
                persist_config=False,
            )
        elif env.get("KUBERNETES_SERVICE_HOST"):
            incluster: Any = k8s_config.load_incluster_config
            incluster(client_configuration=cfg)
        else:
            raise OperatorError(
                "pods need a Kubernetes cluster: set kubernetes.kubeconfig or KUBECONFIG, or "
                "run the gateway in the cluster"
            )
    except k8s_config.ConfigException as exc:
        raise OperatorError(f"the Kubernetes configuration cannot be used: {exc}") from None
    except OSError as exc:  # there, but not readable
        raise OperatorError(f"the kubeconfig {path} cannot be read: {exc.strerror}") from None
    return KubeApi(k8s.ApiClient(cfg))


def _any_file(paths: str) -> bool:
    """Whether one of ``paths`` (``KUBECONFIG``'s list) is a file (once, as the gateway starts)."""
    return any(Path(p).is_file() for p in paths.split(os.pathsep) if p)


def _default_kubeconfig(env: Mapping[str, str]) -> str | None:
    home = env.get("HOME")
    path = Path(home, ".kube", "config") if home else None
    return str(path) if path is not None and path.is_file() else None
