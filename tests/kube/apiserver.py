"""FakeApiServer: core/v1 Pods (and the Events about them) over plain HTTP on 127.0.0.1, as the
real API server answers them: bearer-token auth, create/get/list/watch/update/patch/delete, the
status and log subresources, Status bodies for every failure. Storage and watch semantics are in
store.py, the checks and defaults of a create in objects.py.

On demand: ``fail_next`` answers matching requests with an error, ``lose_next`` carries them out
and cuts the connection before the answer (a reply lost on the way: the client cannot tell
whether the write happened), ``compact`` expires old resourceVersions, ``drop_watches`` cuts
open watches mid-stream, ``bookmark`` sends a BOOKMARK now.

Departures: only Pods and Events exist (namespaces need not); no ``limit``/``continue`` paging
(one page); ``dryRun``, ``propagationPolicy``, server-side apply and the legacy ``/watch/``
paths are not supported; a PUT/PATCH of a pod may change only its labels, annotations and
container images (and a PUT must carry the stored spec: no defaults are applied to it); a
resourceVersion newer than the server's is taken as "from now".
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml
from aiohttp import web

from tests.kube.logs import LogSource, flag, serve_log
from tests.kube.objects import REASONS, ApiError, json_patch, merge_patch, status_body
from tests.kube.selectors import label_key_error, label_value_error
from tests.kube.store import Bookmark, Change, ExpiredError, Store, Watcher

__all__ = ["FakeApiServer", "LogSource"]

Obj = dict[str, Any]
NS = r"/api/v1/namespaces/(?P<ns>[^/]+)"
POD = NS + r"/pods/(?P<name>[^/]+)"


@dataclass
class Fault:
    method: str
    path_contains: str
    status: int
    times: int


def _wire(obj: Obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _answer(obj: Obj, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=_wire(obj), status=status, content_type="application/json", headers=headers
    )


class FakeApiServer:
    def __init__(self, token: str = "fake-token", *, history: int = 1000) -> None:  # noqa: S107
        self.token = token
        self.store = Store(history)
        self.url = ""
        self.calls: list[tuple[str, str, dict[str, str]]] = []
        self.expired_as_http_410 = False
        self.bookmark_interval = 1.0
        self.logs: LogSource | None = None
        self.open_watches = 0
        self._faults: list[Fault] = []
        self._runner: web.AppRunner | None = None
        self._routes: list[tuple[re.Pattern[str], dict[str, Callable[..., Awaitable[web.StreamResponse]]]]] = [
            (re.compile(r"^/api/v1/pods$"), {"GET": self._list}),
            (re.compile(NS + r"/pods$"), {"GET": self._list, "POST": self._create}),
            (re.compile(POD + "$"), {"GET": self._get, "PUT": self._put, "PATCH": self._patch, "DELETE": self._delete}),
            (re.compile(POD + "/status$"), {"GET": self._get, "PUT": self._put_status, "PATCH": self._patch_status}),
            (re.compile(POD + "/log$"), {"GET": self._log}),
            (re.compile(r"^/api/v1(?:" + NS[7:] + r")?/events$"), {"GET": self._events}),
        ]  # fmt: skip

    async def __aenter__(self) -> FakeApiServer:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.store.signal("close")
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """Write a kubeconfig for this server (its URL, the token, ``namespace``) to ``path``."""
        config = {
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}],
            "current-context": "fake",
        }  # fmt: skip
        path.write_text(yaml.safe_dump(config))
        return path

    # faults ---------------------------------------------------------------------------------

    def fail_next(self, method: str, path_contains: str, status: int, times: int = 1) -> None:
        """Answer the next ``times`` requests of ``method`` whose path contains ``path_contains``
        with ``status`` (a Status body; 429 with Retry-After: 1) instead of handling them."""
        self._faults.append(Fault(method.upper(), path_contains, status, times))

    def lose_next(self, method: str, path_contains: str, times: int = 1) -> None:
        """Carry out the next ``times`` requests of ``method`` whose path contains
        ``path_contains``, then cut their connections without an answer."""
        self._faults.append(Fault(method.upper(), path_contains, 0, times))

    def clear_faults(self) -> None:
        """Forget every fault not yet met."""
        self._faults.clear()

    def compact(self) -> None:
        """Forget history: a watch or resume from an older resourceVersion gets 410 Expired."""
        self.store.compact()

    def drop_watches(self) -> None:
        """Cut every open watch as a lost connection would: the transport closes, no last chunk."""
        self.store.signal("drop")

    def bookmark(self) -> None:
        """Send a BOOKMARK now on every open watch that allowed them."""
        self.store.bookmark()

    # dispatch -------------------------------------------------------------------------------

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        self.calls.append((request.method, request.path, dict(request.query)))
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return _answer(status_body(401, "Unauthorized"), 401)
        for fault in self._faults:
            if (
                fault.times > 0
                and fault.method == request.method
                and fault.path_contains in request.path
            ):
                fault.times -= 1
                if fault.status == 0:  # lost: carried out, then the connection is cut
                    answer = await self._route(request)
                    if request.transport is not None:
                        request.transport.abort()
                    return answer
                headers = {"Retry-After": "1"} if fault.status == 429 else None
                reason = REASONS.get(fault.status, "Unknown")
                return _answer(
                    status_body(fault.status, f"injected fault: {reason}"), fault.status, headers
                )
        return await self._route(request)

    async def _route(self, request: web.Request) -> web.StreamResponse:
        for pattern, methods in self._routes:
            if (m := pattern.match(request.path)) is None:
                continue
            if (handler := methods.get(request.method)) is None:
                return _answer(
                    status_body(
                        405, "the server does not allow this method on the requested resource"
                    ),
                    405,
                )
            try:
                return await handler(request, **m.groupdict())
            except ApiError as e:
                return _answer(e.body, e.code)
            except ValueError as e:  # a selector, or a number that is none
                return _answer(status_body(400, str(e)), 400)
        return _answer(
            status_body(404, "the server could not find the requested resource", details={}), 404
        )

    @staticmethod
    async def _body(request: web.Request) -> Any:
        raw = await request.read()
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiError(400, "the body of the request was in an unknown format") from None

    # pods -----------------------------------------------------------------------------------

    async def _create(self, request: web.Request, ns: str) -> web.Response:
        return _answer(self.store.create_pod(ns, await self._body(request)), 201)

    async def _list(self, request: web.Request, ns: str | None = None) -> web.StreamResponse:
        q = request.query
        if flag(q.get("watch")):
            return await self._watch(request, ns)
        items = self.store.list_pods(ns, q.get("labelSelector"), q.get("fieldSelector"))
        for item in items:
            item.pop("kind", None)
            item.pop("apiVersion", None)
        meta = {"resourceVersion": str(self.store.rv)}
        return _answer({"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": items})

    async def _get(self, request: web.Request, ns: str, name: str) -> web.Response:
        return _answer(self.store.get_pod(ns, name))

    async def _delete(self, request: web.Request, ns: str, name: str) -> web.Response:
        body = await self._body(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the body of the request was in an unknown format")
        grace = request.query.get("gracePeriodSeconds", body.get("gracePeriodSeconds"))
        pre = body.get("preconditions") or {}
        try:
            period = None if grace is None else int(grace)
        except ValueError:
            raise ApiError(400, f"gracePeriodSeconds: Invalid value: {grace!r}") from None
        return _answer(
            self.store.delete_pod(
                ns, name, period, uid=pre.get("uid"), rv=pre.get("resourceVersion")
            )
        )

    async def _put(self, request: web.Request, ns: str, name: str) -> web.Response:
        return _answer(self._update(ns, name, await self._body(request)))

    async def _patch(self, request: web.Request, ns: str, name: str) -> web.Response:
        return _answer(
            self._update(
                ns,
                name,
                self._patched(request, self.store.get_pod(ns, name), await self._body(request)),
            )
        )

    def _update(self, ns: str, name: str, new: Any) -> Obj:
        """A write to the pod itself: only labels, annotations and container images may change;
        its status is ignored (that is the status subresource's)."""
        if (
            not isinstance(new, dict)
            or not isinstance(new.get("metadata"), dict)
            or not isinstance(new.get("spec"), dict)
        ):
            raise ApiError(400, "the body of the request was in an unknown format")
        if new["metadata"].get("name", name) != name:
            raise ApiError(400, "the name of the object does not match the name on the URL")
        old = self.store.get_pod(ns, name)
        images = [c.get("image") for c in new["spec"].get("containers") or []]
        masked = {
            **new["spec"],
            "containers": [{**c, "image": None} for c in new["spec"].get("containers") or []],
        }
        if masked != {
            **old["spec"],
            "containers": [{**c, "image": None} for c in old["spec"]["containers"]],
        } or not all(images):
            raise ApiError.invalid(
                name,
                [
                    (
                        "spec",
                        "FieldValueForbidden",
                        "Forbidden: pod updates may not change fields other than `spec.containers[*].image`, `spec.initContainers[*].image`, `spec.activeDeadlineSeconds`, `spec.tolerations` (only additions to existing tolerations), `spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)",
                    )
                ],
            )
        labels = new["metadata"].get("labels") or {}
        for key, value in labels.items():
            if (err := label_key_error(key) or label_value_error(str(value))) is not None:
                raise ApiError.invalid(
                    name, [("metadata.labels", "FieldValueInvalid", f"Invalid value: {err}")]
                )

        def apply(pod: Obj) -> None:
            for key in ("labels", "annotations"):
                pod["metadata"].pop(key, None)
                if new["metadata"].get(key):
                    pod["metadata"][key] = new["metadata"][key]
            if images != [c["image"] for c in pod["spec"]["containers"]]:
                for c, image in zip(pod["spec"]["containers"], images, strict=True):
                    c["image"] = image
                pod["metadata"]["generation"] += 1

        return self.store.update_pod(
            ns, name, apply, expect_rv=new["metadata"].get("resourceVersion")
        )

    @staticmethod
    def _patched(request: web.Request, current: Obj, patch: Any) -> Obj:
        kind = request.content_type
        if kind == "application/json-patch+json":
            return json_patch(current, patch)
        if kind not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            raise ApiError(
                415,
                f"the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json (not {kind})",
            )
        if not isinstance(patch, dict):
            raise ApiError(400, "the body of the request was in an unknown format")
        out: Obj = merge_patch(current, patch, strategic=kind.startswith("application/strategic"))
        return out

    async def _put_status(self, request: web.Request, ns: str, name: str) -> web.Response:
        body = await self._body(request)
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise ApiError(400, "the body of the request was in an unknown format")
        if body.get("metadata", {}).get("name", name) != name:
            raise ApiError(400, "the name of the object does not match the name on the URL")
        status = body.get("status") or {}

        def set_status(pod: Obj) -> None:
            pod["status"] = status

        return _answer(
            self.store.update_pod(
                ns, name, set_status, expect_rv=body.get("metadata", {}).get("resourceVersion")
            )
        )

    async def _patch_status(self, request: web.Request, ns: str, name: str) -> web.Response:
        current = self.store.get_pod(ns, name)
        new = self._patched(request, current, await self._body(request))
        status = new.get("status") or {}

        def set_status(pod: Obj) -> None:
            pod["status"] = status

        return _answer(
            self.store.update_pod(
                ns, name, set_status, expect_rv=new["metadata"].get("resourceVersion")
            )
        )

    async def _events(self, request: web.Request, ns: str | None = None) -> web.Response:
        items = self.store.list_events(ns, request.query.get("fieldSelector"))
        meta = {"resourceVersion": str(self.store.rv)}
        return _answer({"kind": "EventList", "apiVersion": "v1", "metadata": meta, "items": items})

    async def _log(self, request: web.Request, ns: str, name: str) -> web.StreamResponse:
        return await serve_log(request, self.store.get_pod(ns, name), self.logs)

    # watch ----------------------------------------------------------------------------------

    async def _watch(self, request: web.Request, ns: str | None) -> web.StreamResponse:
        q = request.query
        w: Watcher | None = self.store.watcher(ns, q.get("labelSelector"), q.get("fieldSelector"))
        assert w is not None
        try:
            initial = self.store.watch(w, q.get("resourceVersion"))
        except ExpiredError as e:
            gone = status_body(410, e.message, "Expired")
            if self.expired_as_http_410:
                return _answer(gone, 410)
            initial, w = [("ERROR", gone)], None  # the real server: 200, one ERROR event, the end
        out = web.StreamResponse(headers={"Content-Type": "application/json"})
        out.enable_chunked_encoding()
        await out.prepare(request)
        bookmarks = flag(q.get("allowWatchBookmarks"))
        loop = asyncio.get_running_loop()
        ends = loop.time() + float(q["timeoutSeconds"]) if "timeoutSeconds" in q else None
        self.open_watches += w is not None
        try:
            for kind, obj in initial:
                await out.write(_wire({"type": kind, "object": obj}) + b"\n")
            next_mark = loop.time() + self.bookmark_interval
            while w is not None:
                wake = min(
                    t
                    for t in (ends, next_mark if bookmarks else None, loop.time() + 3600)
                    if t is not None
                )
                try:
                    item = await asyncio.wait_for(w.queue.get(), max(0.0, wake - loop.time()))
                except TimeoutError:
                    if ends is not None and loop.time() >= ends:
                        break
                    item = Bookmark(self.store.rv) if loop.time() >= next_mark else "none"
                if item == "drop":
                    if request.transport is not None:
                        request.transport.abort()
                    return out
                if item == "close":
                    break
                if isinstance(item, Bookmark) and bookmarks:
                    next_mark = loop.time() + self.bookmark_interval
                    mark = {
                        "kind": "Pod",
                        "apiVersion": "v1",
                        "metadata": {"resourceVersion": str(item.rv)},
                    }
                    await out.write(_wire({"type": "BOOKMARK", "object": mark}) + b"\n")
                elif isinstance(item, Change) and (event := w.convert(item)) is not None:
                    await out.write(_wire({"type": event[0], "object": event[1]}) + b"\n")
            await out.write_eof()
        except ConnectionError:
            pass  # the client went away
        finally:
            if w is not None:
                self.store.unwatch(w)
                self.open_watches -= 1
        return out
