"""An engine run as a Kubernetes pod (a `Runner`): its ``launch:`` command in the pod its
``pod:`` describes (``manifest.py``), on the cluster the gateway's ``kubernetes:`` names.

- **start** creates a new bare Pod and waits, on the namespace's watch, for its Ready condition;
  then the gateway checks the engine's ``/health`` at the pod's address itself, and the
  collector polls it from there. A pod the scheduler cannot place waits, its reason shown; a
  pod that fails, or is not ready within ``launch.startup_timeout``, fails the start (the
  latter is deleted).
- **stop** deletes it with its grace period; the stop is proven once the watch no longer has
  that pod (its DELETED event, a list without it, or a 404). A delete that is not proven is
  owed (``deletes.py``): tried again until the pod is gone, and the next start waits for it
  (never two pods for one instance). A stop during a start deletes the pod at once.
- **exits**: its container ended, the pod failed or was evicted, or Kubernetes deleted it
  (its node lost): `gone` says so at once.
- **park / wake** are the engine's own routes, as on one machine.

The engine outlives the gateway (a restarted gateway takes its pods up: ``cluster.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiohttp

from canopyx_provider import Collector, adapter_for

from .._config import KUBERNETES_POOL, Deployment, Pod
from .._deployments.parking import drive
from .._deployments.routes import EngineInstance
from .._deployments.runner import Described, ProcessView, Site, Tracked, never
from .._deployments.seen import Seen, SeenBy
from .._deployments.wakecheck import auth_of, check, record
from .._errors import EngineControlError, StartFailedError
from .cluster import Cluster
from .creating import create
from .deletes import holding, settled
from .manifest import manifest, named
from .podlog import PodLog
from .podrun import PodRun
from .podstate import lines, node_of, pending, placed, pod_url, serving, shown
from .starting import healthy, until_ready
from .watch import PodWatch, uid_of

__all__ = ["PodRunner"]

logger = logging.getLogger("capyctl_gateway")


class PodRunner(SeenBy):
    """One instance's engine as a pod."""

    def __init__(
        self,
        inst: EngineInstance,
        deployment: Deployment,
        pod: Pod,
        cluster: Cluster,
        *,
        collector: Collector,
        session: aiohttp.ClientSession,
        clock: Callable[[], float],
    ) -> None:
        if inst.launch is None:
            raise StartFailedError(f"{inst.where}: a pod runs a launch: command")
        self.instance, self._dep, self._pod, self._cluster = inst, deployment, pod, cluster
        self._launch, self._session = inst.launch, session
        self.namespace, self.grace_s = pod.namespace or cluster.kube.namespace, pod.grace_period
        self._body, self.spec_hash = manifest(
            cluster.kube, deployment, inst.index, inst.launch, pod
        )
        self.site = Site(
            pool=KUBERNETES_POOL,
            machine=None,
            on=f"on Kubernetes, namespace {self.namespace}",
            stopper="Kubernetes",
            outlives_gateway=True,
            run_by="the gateway (pods)",
        )
        self.seen = Seen(collector, inst.key, clock)
        self._run: PodRun | None = None
        self._recorded: str | None = None
        self._log: PodLog | None = None
        self.labels: dict[str, str] = self._body["metadata"]["labels"]  # its pods' (a restart's)

    # -- what it reads ------------------------------------------------------------------------
    def _watch(self) -> PodWatch:
        w = self._cluster.watch(self.namespace)
        if w is None:
            raise StartFailedError(NOT_REACHED, began=False)
        return w

    def cannot_start(self) -> str | None:
        return _unstartable(self._cluster.watch(self.namespace))

    def _current(self) -> dict[str, Any] | None:
        return self._run.pod() if self._run is not None else None

    def process(self) -> ProcessView | None:
        return None  # its process is the kubelet's, on its node

    def describe(self) -> Described:
        fields: dict[str, Any] = {}
        if (pod := self._current()) is not None:
            fields["pod"] = shown(pod)
        w = self._cluster.watch(self.namespace)
        if w is not None and w.broken is not None:
            fields["pod_watch"] = f"down: {w.broken}"
        if debts := self._cluster.owed_by(self.instance.where):
            fields["pod_deletes_owed"] = [d.row() for d in debts]
        described = self.seen.described(lines(fields), **fields)
        return replace(described, placed=placed(fields["pod"]) if "pod" in fields else None)

    def holdup(self) -> str | None:
        """Why its engine is not up yet where Kubernetes says (a pod nothing can place, an
        earlier pod still being deleted)."""
        pod = self._current()
        why = pending(pod, detail=False) if pod is not None else None
        if why is None:
            return holding(self._cluster.owed_by(self.instance.where))
        return f"its pod waits: {why}"

    def log(self) -> PodLog | None:
        return self._log

    def why_unreachable(self) -> str:
        return "dispatch_closed"

    def begin(self, exchange: Tracked) -> None:
        """Nothing ends an exchange with a pod from outside (its exit is `gone`'s)."""

    end = begin

    # -- what it does -------------------------------------------------------------------------
    def adopt(self, pod: dict[str, Any]) -> None:
        """Take up a ready pod a previous run of the gateway left (``cluster.py``)."""
        name = str(pod["metadata"]["name"])
        self._run = PodRun(self._cluster, self.namespace, name, uid_of(pod))
        self._log = PodLog.of(self._cluster, self.namespace, name, self.instance)
        url = pod_url(pod, self._pod.port)
        if url is not None:
            self.instance.bind(url)
            self._watch_engine()

    async def start(self, reason: str) -> str:
        w = self._watch()
        pod = self._current()
        if pod is not None and serving(pod):
            return "its pod was running already"  # taken up from a previous run
        await self._delete("a new start")  # what is left of an earlier run's pod
        await settled(self._cluster.owed_by, self.instance.where, w, self._launch.startup_timeout)
        body = named(self._body, self._dep, self.instance.index)
        self._run = await create(self._cluster, body, self)
        name = self._run.name
        self._log = PodLog.of(self._cluster, self.namespace, name, self.instance)
        try:
            pod = await until_ready(w, self._current, name, self._launch.startup_timeout)
            url = pod_url(pod, self._pod.port)
            if url is None:
                raise StartFailedError(f"its pod {name} is ready but has no address")
            await healthy(self._session, url, auth_of(self.instance), name)
        except EngineControlError as exc:
            exc.lingers = not await self._delete(f"its start failed: {exc.message}")
            raise
        except BaseException:  # abandoned (an operator's stop): its pod is deleted at once
            await self._delete("its start was abandoned")
            raise
        self.instance.bind(url)
        self._watch_engine()
        d = self._dep
        if d.parks and not d.router:
            self._recorded = await record(self._session, self.instance, d)
        return f"its pod {name} is ready on node {node_of(pod) or '(unknown)'}"

    def _watch_engine(self) -> None:
        inst, d = self.instance, self._dep
        if not self.seen.watched and inst.url is not None:
            adapter = adapter_for(d.engine, inst.url, api_key=inst.engine_key, router=d.router)
            self.seen.watch(adapter, d.engine_model)

    async def park(self, reason: str) -> None:
        await self._drive(park=True)

    async def wake(self, reason: str) -> None:
        await self._drive(park=False)
        if self._recorded is not None:
            await check(self._session, self.instance, self._dep, self._recorded)

    async def _drive(self, *, park: bool) -> None:
        inst, d = self.instance, self._dep
        if inst.url is None:
            raise StartFailedError(f"{inst.where} has no engine to drive")
        model = d.engine_model if d.router else None
        await drive(self._session, d.engine, inst.url, auth_of(inst), model, park=park)

    async def stop(self, reason: str) -> bool:
        self.seen.unwatch()
        return await self._delete(reason)

    async def _delete(self, why: str) -> bool:
        """Delete this run's pod; whether no pod of this instance is left (one whose delete
        is not proven is owed: the lifecycle hears when it is gone at last)."""
        run, self._run = self._run, None
        where = self.instance.where
        if run is not None and (failed := await run.delete(self.grace_s)) is not None:
            self._cluster.owe(run, where, f"{why}: {failed}", grace_s=self.grace_s, runner=self)
        return not self._cluster.owed_by(where)

    @property
    def idle(self) -> bool:
        """No run of its engine is under way (it is stopped)."""
        return self._run is None

    def exited(self) -> str | None:
        return self._run.exited() if self._run is not None else None

    async def gone(self) -> str:
        w = self._cluster.watch(self.namespace)
        if w is None:
            return await never()
        while True:
            if (why := self.exited()) is not None:
                return why
            await w.changed()


NOT_REACHED = "the Kubernetes API was not reached when the gateway started"


def _unstartable(w: PodWatch | None) -> str | None:
    """Why no pod can be started in ``w``'s namespace now (the API cannot be reached)."""
    if w is None:
        return NOT_REACHED
    if w.unreachable:
        return f"the Kubernetes API cannot be reached now (its pod watch is down: {w.broken})"
    return None
