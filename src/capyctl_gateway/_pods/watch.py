"""What the API server says of the gateway's pods in one namespace, kept by one list-then-watch
(never one watch per pod), as client-go's reflectors keep it:

- list the pods the owner's selector matches, then watch from the list's resourceVersion, with
  bookmarks (they move the resourceVersion on while nothing of ours changes);
- a watch the API server ends (``kubernetes.watch_timeout``) is renewed from where it was;
- a 410 Gone (the version was compacted away) lists again: a pod missing from the new list
  is gone, as a DELETED event would have said;
- an event past the client's bound lists again too (resumed, the watch would meet it again);
- any other failure (a cut connection, a refusal, an unreachable server) waits a jittered
  backoff, doubling up to `BACKOFF_MAX_S` while failures follow each other (a watch that ran
  before it failed starts it over), and tries again; ``broken`` says why meanwhile.

Its owner (``cluster.py``) runs it as a kept loop: a defect in it is logged and counted, the
watch is down meanwhile (`down`: nothing is concluded from a pod missing while it is), and it
lists again after the supervisor's backoff. Runners read ``pods`` and wait on `changed`;
nothing here decides anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from typing import Any

from .._clock import stamp
from .kube import ExpiredError, KubeApi, KubeError

__all__ = ["BACKOFF_MAX_S", "PodWatch", "uid_of"]

logger = logging.getLogger("capyctl_gateway")

BACKOFF_FIRST_S = 0.2
BACKOFF_MAX_S = 30.0
DOWN_AFTER = 3
"""Failures in a row after which the API server counts as unreachable (`PodWatch.unreachable`):
no start begins then, and nothing is switched out for one."""
QUICK_END_S = 1.0
"""A watch that ends sooner than this without an event counts as a failure (no busy loop
against a server that closes every watch at once)."""


def uid_of(pod: dict[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid") or "")


def _name(pod: dict[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("name") or "")


def _jittered(failed: int) -> float:
    """The wait after ``failed`` failures in a row."""
    wait: float = min(BACKOFF_FIRST_S * 2.0 ** (failed - 1), BACKOFF_MAX_S)
    return wait * random.uniform(0.5, 1.0)  # noqa: S311 (jitter)


class PodWatch:
    """The gateway's pods in one namespace, as last heard."""

    def __init__(self, api: KubeApi, namespace: str, selector: str, timeout_s: float) -> None:
        self.api, self.namespace, self.selector, self.timeout_s = (
            api,
            namespace,
            selector,
            timeout_s,
        )
        self.pods: dict[str, dict[str, Any]] = {}
        """name -> the pod's latest object."""
        self.rv = ""
        self.listed = asyncio.Event()
        """Set once a list has been taken (what ``pods`` says is then the server's)."""
        self.lists = 0
        self.renewals = 0
        """Watches renewed after the API server ended them."""
        self.failures = 0
        """Watches or lists that failed (cut, refused, unreachable), each followed by a wait."""
        self.broken: str | None = None
        """Why the watch is down now; None while it runs."""
        self.failing = 0
        """Failures in a row, none of them after a watch that ran."""
        self._changed = asyncio.Event()

    @property
    def unreachable(self) -> bool:
        """Whether the API server failed `DOWN_AFTER` watches in a row, or no list since."""
        return self.broken is not None and (not self.listed.is_set() or self.failing >= DOWN_AFTER)

    @property
    def current(self) -> bool:
        """Whether ``pods`` is the server's word now: listed, and the watch runs (a pod missing
        from it is gone; while the watch is down, a missing pod proves nothing)."""
        return self.listed.is_set() and self.broken is None

    async def changed(self) -> None:
        """Return at the next change of ``pods`` (or of ``broken``)."""
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def down(self, why: str) -> None:
        """Down for ``why`` (a defect): what it holds counts again once it lists."""
        self.broken = why
        self.listed.clear()
        self._notify()

    async def run(self) -> None:
        """Keep ``pods`` true, for as long as its owner lets it run."""
        self.failing = 0
        while True:
            began, events = stamp(), 0
            try:
                if not self.listed.is_set():
                    await self._list()
                watch = self.api.watch(self.namespace, self.selector, self.rv, self.timeout_s)
                async with contextlib.aclosing(watch):  # its response released as it ends
                    async for kind, obj in watch:
                        events += 1
                        self._apply(kind, obj)
                if events == 0 and stamp() - began < QUICK_END_S:
                    raise KubeError(200, "Ended", "the API server ended the watch at once")
                self.renewals += 1
                self.failing = 0
            except ExpiredError:
                logger.info(
                    "pods in %s: the watch's version expired; listing again", self.namespace
                )
                self.listed.clear()
            except KubeError as exc:
                if events or stamp() - began >= QUICK_END_S:
                    self.failing = 0  # it ran before it failed: the backoff starts over
                self.failing += 1
                self.failures += 1
                wait = _jittered(self.failing)
                if self.broken is None:
                    logger.warning(
                        "pods in %s: the watch failed (%s); trying again in %.1f s",
                        self.namespace,
                        exc,
                        wait,
                    )
                self.broken = str(exc)
                if exc.reason == "TooLarge":  # resumed, it would meet the same event again
                    self.listed.clear()
                self._notify()
                await asyncio.sleep(wait)

    async def _list(self) -> None:
        items, rv = await self.api.list(self.namespace, self.selector)
        self.lists += 1
        fresh = {_name(p): p for p in items if _name(p)}
        self.pods = fresh  # one missing from it was deleted meanwhile
        self.rv = rv
        self.broken = None
        self.listed.set()
        self._notify()

    def _apply(self, kind: str, obj: dict[str, Any]) -> None:
        rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        if rv:
            self.rv = rv
        if self.broken is not None:
            logger.info("pods in %s: the watch runs again", self.namespace)
            self.broken = None
        name = _name(obj)
        if kind in ("ADDED", "MODIFIED") and name:
            self.pods[name] = obj
        elif kind == "DELETED" and name:
            held = self.pods.get(name)
            if held is not None and uid_of(held) == uid_of(obj):
                del self.pods[name]
        else:
            return  # a bookmark: only its version counts
        self._notify()
