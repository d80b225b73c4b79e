"""The fake API server's storage: Pods and Events, one global resourceVersion, a bounded history
of Pod changes, and the watchers that follow it. Every write, from the HTTP routes or from the
fake kubelet and scheduler, goes through here: it bumps the resourceVersion and notifies the
watchers, and a write that changes nothing is no write (as etcd's guaranteed update).

A watcher with a selector sees an object that starts matching as ADDED and one that stops
matching as DELETED (its previous state, at the event's resourceVersion), as the watch cache does.
"""

from __future__ import annotations

import asyncio
import copy
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from tests.kube.objects import ApiError, new_identity, now, prepare_pod
from tests.kube.selectors import FieldSelector, LabelSelector

__all__ = ["Bookmark", "Change", "ExpiredError", "Store", "Watcher"]

Obj = dict[str, Any]
POD_FIELDS: dict[str, Callable[[Obj], str]] = {
    "metadata.name": lambda p: p["metadata"]["name"],
    "metadata.namespace": lambda p: p["metadata"]["namespace"],
    "spec.nodeName": lambda p: p["spec"].get("nodeName", ""),
    "spec.restartPolicy": lambda p: p["spec"].get("restartPolicy", ""),
    "spec.schedulerName": lambda p: p["spec"].get("schedulerName", ""),
    "spec.serviceAccountName": lambda p: p["spec"].get("serviceAccountName", ""),
    "status.phase": lambda p: p["status"].get("phase", ""),
    "status.podIP": lambda p: p["status"].get("podIP", ""),
}
EVENT_FIELDS = ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                "involvedObject.uid", "reason", "type", "source", "metadata.name",
                "metadata.namespace")  # fmt: skip


@dataclass(frozen=True)
class Change:
    """One write to a Pod. For DELETED, ``obj`` is its last state at the deletion's RV."""

    rv: int
    type: str
    obj: Obj
    prev: Obj | None


@dataclass(frozen=True)
class Bookmark:
    rv: int


class ExpiredError(Exception):
    """A watch asked to start before what the history holds (HTTP 410 Gone / ERROR event)."""

    def __init__(self, asked: int, oldest: int) -> None:
        super().__init__(f"too old resource version: {asked} ({oldest})")
        self.message = str(self)


@dataclass(eq=False)
class Watcher:
    namespace: str | None
    labels: LabelSelector
    fields: FieldSelector
    queue: asyncio.Queue[Change | Bookmark | str] = field(default_factory=asyncio.Queue)

    def passes(self, pod: Obj | None) -> bool:
        if pod is None:
            return False
        meta = pod["metadata"]
        return (self.namespace in (None, meta["namespace"]) and self.labels.matches(meta.get("labels"))
                and self.fields.matches(lambda f: POD_FIELDS[f](pod)))  # fmt: skip

    def convert(self, change: Change) -> tuple[str, Obj] | None:
        """The event this watcher sees for ``change``, if any (the watch cache's rule)."""
        now_passes = change.type != "DELETED" and self.passes(change.obj)
        before = self.passes(change.prev)
        if now_passes:
            return ("MODIFIED" if before else "ADDED"), change.obj
        if before and change.prev is not None:
            gone = copy.deepcopy(change.prev)
            gone["metadata"]["resourceVersion"] = str(change.rv)
            return "DELETED", gone
        return None


class Store:
    def __init__(self, history: int = 1000) -> None:
        self.rv = 1
        self.floor = 0  # compaction: a watch from an RV below this is too old
        self.trimmed = 0  # the newest RV the bounded history has forgotten
        self.pods: dict[tuple[str, str], Obj] = {}
        self.events: dict[tuple[str, str], Obj] = {}
        self.history: deque[Change] = deque(maxlen=history)
        self.watchers: set[Watcher] = set()

    # writes --------------------------------------------------------------------------------

    def _commit(self, kind: str, obj: Obj, prev: Obj | None) -> Obj:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if kind == "DELETED":
            self.pods.pop(key, None)
        else:
            self.pods[key] = obj
        if len(self.history) == self.history.maxlen:
            self.trimmed = self.history[0].rv
        change = Change(self.rv, kind, copy.deepcopy(obj), copy.deepcopy(prev))
        self.history.append(change)
        for w in self.watchers:
            w.queue.put_nowait(change)
        return copy.deepcopy(obj)

    def create_pod(self, namespace: str, body: Any) -> Obj:
        pod = prepare_pod(body, namespace)
        name = pod["metadata"]["name"]
        if (namespace, name) in self.pods:
            raise ApiError(
                409,
                f'pods "{name}" already exists',
                "AlreadyExists",
                {"name": name, "kind": "pods"},
            )
        new_identity(pod["metadata"])
        return self._commit("ADDED", pod, None)

    def update_pod(
        self,
        namespace: str,
        name: str,
        mutate: Callable[[Obj], object],
        *,
        expect_rv: str | None = None,
    ) -> Obj:
        """Apply ``mutate`` to a copy of the pod and store it; no write if nothing changed.
        With ``expect_rv``, a pod since written by someone else is a 409 Conflict."""
        old = self._pod(namespace, name)
        if expect_rv and expect_rv != old["metadata"]["resourceVersion"]:
            raise ApiError.conflict(name)
        new = copy.deepcopy(old)
        mutate(new)
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if new == old:
            return copy.deepcopy(old)
        return self._commit("MODIFIED", new, old)

    def delete_pod(self, namespace: str, name: str, grace: int | None = None, *, uid: str | None = None,
                   rv: str | None = None) -> Obj:  # fmt: skip
        """DELETE as the pod strategy does it: at once when unbound, terminal or with grace 0;
        otherwise graceful (deletionTimestamp), and a later delete may only shorten it."""
        pod = self._pod(namespace, name)
        meta = pod["metadata"]
        if uid is not None and uid != meta["uid"]:
            raise ApiError(409, f"Precondition failed: UID in precondition: {uid}, UID in object meta: {meta['uid']}",
                           "Conflict", {"name": name, "kind": "pods"})  # fmt: skip
        if rv is not None and rv != meta["resourceVersion"]:
            raise ApiError(409, f"Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {meta['resourceVersion']}",
                           "Conflict", {"name": name, "kind": "pods"})  # fmt: skip
        period = (
            grace if grace is not None else pod["spec"].get("terminationGracePeriodSeconds", 30)
        )
        if not pod["spec"].get("nodeName") or pod["status"].get("phase") in ("Succeeded", "Failed"):
            period = 0
        if (
            period > 0
            and meta.get("deletionTimestamp")
            and period >= meta.get("deletionGracePeriodSeconds", 0)
        ):
            return copy.deepcopy(pod)  # already terminating, no sooner
        if period > 0:

            def terminate(p: Obj) -> None:
                at = datetime.now(UTC) + timedelta(seconds=period)
                p["metadata"]["deletionTimestamp"] = at.strftime("%Y-%m-%dT%H:%M:%SZ")
                p["metadata"]["deletionGracePeriodSeconds"] = period
                if "deletionTimestamp" not in meta:
                    p["metadata"]["generation"] = meta.get("generation", 1) + 1

            return self.update_pod(namespace, name, terminate)
        gone = copy.deepcopy(pod)
        if "deletionTimestamp" in meta:  # a graceful deletion, now over
            gone["metadata"].update(deletionTimestamp=now(), deletionGracePeriodSeconds=0)
        return self._commit("DELETED", gone, pod)

    def record_event(self, pod: Obj, reason: str, message: str, *, type_: str = "Warning",
                     component: str = "default-scheduler", host: str | None = None) -> Obj:  # fmt: skip
        """Record an Event about ``pod``; the same one again counts up (the event recorder's
        aggregation)."""
        meta = pod["metadata"]
        for ev in self.events.values():
            inv = ev["involvedObject"]
            if (inv["uid"], ev["reason"], ev["message"], ev["source"]["component"]) == (
                meta["uid"],
                reason,
                message,
                component,
            ):
                ev["count"] += 1
                ev["lastTimestamp"] = now()
                self.rv += 1
                ev["metadata"]["resourceVersion"] = str(self.rv)
                return copy.deepcopy(ev)
        self.rv += 1
        stamp = now()
        name = f"{meta['name']}.{self.rv:016x}"
        source = {"component": component, **({"host": host} if host else {})}
        ev = {"metadata": {"name": name, "namespace": meta["namespace"], "uid": f"ev-{self.rv}",
                           "resourceVersion": str(self.rv), "creationTimestamp": stamp},
              "involvedObject": {"kind": "Pod", "namespace": meta["namespace"], "name": meta["name"],
                                 "uid": meta["uid"], "apiVersion": "v1", "resourceVersion": meta["resourceVersion"]},
              "reason": reason, "message": message, "source": source, "type": type_, "count": 1,
              "firstTimestamp": stamp, "lastTimestamp": stamp, "reportingComponent": component,
              "reportingInstance": host or ""}  # fmt: skip
        self.events[(meta["namespace"], name)] = ev
        return copy.deepcopy(ev)

    # reads ---------------------------------------------------------------------------------

    def _pod(self, namespace: str, name: str) -> Obj:
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise ApiError.not_found(name)
        return pod

    def get_pod(self, namespace: str, name: str) -> Obj:
        return copy.deepcopy(self._pod(namespace, name))

    def list_pods(
        self, namespace: str | None, labels: str | None = None, fields: str | None = None
    ) -> list[Obj]:
        w = self.watcher(namespace, labels, fields)
        return [copy.deepcopy(p) for p in sorted(self.pods.values(), key=_key) if w.passes(p)]

    def list_events(self, namespace: str | None, fields: str | None = None) -> list[Obj]:
        sel = FieldSelector.parse(fields, lambda f: f in EVENT_FIELDS)
        out = []
        for ev in self.events.values():

            def value(f: str, ev: Obj = ev) -> str:
                if f == "source":
                    return str(ev["source"]["component"])
                first, _, rest = f.partition(".")
                return str(ev[first][rest] if rest else ev[first])

            if namespace in (None, ev["metadata"]["namespace"]) and sel.matches(value):
                out.append(copy.deepcopy(ev))
        return out

    # watches -------------------------------------------------------------------------------

    def watcher(
        self, namespace: str | None, labels: str | None = None, fields: str | None = None
    ) -> Watcher:
        """A (not yet subscribed) filter; raises SelectorError on a malformed selector."""
        return Watcher(
            namespace,
            LabelSelector.parse(labels),
            FieldSelector.parse(fields, POD_FIELDS.__contains__),
        )

    def watch(self, w: Watcher, resource_version: str | None) -> list[tuple[str, Obj]]:
        """Subscribe ``w``; the events it is owed before live ones (synthetic ADDED for all
        current pods with no RV or "0", else the history after that RV). Raises ExpiredError."""
        if resource_version in (None, "", "0"):
            initial = [
                ("ADDED", copy.deepcopy(p))
                for p in sorted(self.pods.values(), key=_key)
                if w.passes(p)
            ]
        else:
            try:
                asked = int(str(resource_version))
            except ValueError:
                raise ApiError(
                    400, f"resourceVersion: Invalid value: {resource_version!r}"
                ) from None
            oldest = max(self.floor, self.trimmed)
            if asked < oldest:
                raise ExpiredError(asked, oldest)
            initial = [
                ev for c in self.history if c.rv > asked and (ev := w.convert(c)) is not None
            ]
        self.watchers.add(w)
        return initial

    def unwatch(self, w: Watcher) -> None:
        self.watchers.discard(w)

    def compact(self) -> None:
        self.floor = self.rv

    def bookmark(self) -> None:
        for w in self.watchers:
            w.queue.put_nowait(Bookmark(self.rv))

    def signal(self, what: str) -> None:
        """Put ``what`` ("drop", "close") in every watcher's queue."""
        for w in self.watchers:
            w.queue.put_nowait(what)


def _key(pod: Obj) -> tuple[str, str]:
    return pod["metadata"]["namespace"], pod["metadata"]["name"]
