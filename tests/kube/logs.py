"""The pod log route (``GET .../pods/{name}/log``) as the API server answers it from what the
kubelet kept: ``container``, ``tailLines``, ``limitBytes``, ``previous`` and ``follow``.

Departures: ``sinceSeconds``, ``sinceTime`` and ``timestamps`` are ignored; a pod not yet bound
answers "waiting to start" as a bound one does.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from tests.kube.objects import ApiError

__all__ = ["LogSource", "flag", "serve_log"]

Obj = dict[str, Any]


class LogSource(Protocol):
    """Where the log route reads a container's output (the fake kubelet)."""

    def log_file(self, pod: Obj, container: str, previous: bool) -> Path: ...  # raises ApiError
    def writing(self, pod: Obj) -> bool: ...  # whether more output may come (for follow)


def flag(value: str | None) -> bool:
    """A boolean query parameter as Go's strconv.ParseBool reads it."""
    return value in ("1", "t", "T", "true", "True", "TRUE")


def _int(q: Any, key: str) -> int | None:
    try:
        return int(q[key]) if key in q else None
    except ValueError:
        raise ApiError(400, f"{key}: Invalid value: {q[key]!r}") from None


async def serve_log(request: web.Request, pod: Obj, source: LogSource | None) -> web.StreamResponse:
    q, name = request.query, pod["metadata"]["name"]
    names = [c["name"] for c in pod["spec"]["containers"]]
    container = q.get("container") or (names[0] if len(names) == 1 else None)
    if container is None:
        choose = " ".join(names)
        raise ApiError(
            400, f"a container name must be specified for pod {name}, choose one of: [{choose}]"
        )
    if container not in names:
        raise ApiError(400, f"container {container} is not valid for pod {name}")
    if source is None:
        raise ApiError(
            400, f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating'
        )
    path = source.log_file(pod, container, flag(q.get("previous")))
    data = path.read_bytes()
    offset = len(data)  # what follow reads on from: the file may grow while the head is sent
    lines, limit = _int(q, "tailLines"), _int(q, "limitBytes")
    if lines is not None:
        data = b"".join(data.splitlines(keepends=True)[-lines:]) if lines > 0 else b""
    if not flag(q.get("follow")):
        return web.Response(body=data[:limit], content_type="text/plain")
    out = web.StreamResponse(headers={"Content-Type": "text/plain"})
    out.enable_chunked_encoding()
    await out.prepare(request)
    sent = 0
    try:
        while True:  # until the container is done and all it wrote is sent
            if data and (limit is None or sent < limit):
                chunk = data if limit is None else data[: limit - sent]
                await out.write(chunk)
                sent += len(chunk)
            more = source.writing(pod)
            await asyncio.sleep(0.05)
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
            offset += len(data)
            if not more and not data:
                break
        await out.write_eof()
    except ConnectionError:
        pass  # the client went away
    return out
