"""This gateway's pods on its cluster: the API's client, one watch per namespace (``watch.py``),
and the pod runners that read them.

Opened once before any engine starts (the ``pod`` kind's preparation, ``_runners.py``): it
connects with the operator's credentials, lists each namespace's pods of the owner, and takes
up those a previous run left: a ready pod whose labels name a configured instance and whose
spec hash is the configuration's is adopted (the lifecycle hears it found ready, as a host's
engine is found); every other pod of the owner is deleted. The watches run in the cluster's own
supervisor until the fleet closes, after the lifecycle has stopped what it stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from .._config import Kubernetes
from .._deployments.routes import EngineInstance
from .._tasks import Supervisor
from .kube import CALL_TIMEOUT_S, KubeApi, KubeError, connect
from .manifest import DEPLOYMENT, INSTANCE, SPEC, selector
from .podstate import serving
from .watch import PodWatch, uid_of

if TYPE_CHECKING:
    from .podrun import PodRun

__all__ = ["Adopter", "Cluster"]

logger = logging.getLogger("capyctl_gateway")


class Adopter(Protocol):
    """A pod runner, as the cluster takes up a previous run's pods for it."""

    instance: EngineInstance
    namespace: str
    spec_hash: str

    @property
    def idle(self) -> bool: ...

    def adopt(self, pod: dict[str, Any]) -> None: ...


class Cluster:
    """The gateway's pods on one cluster."""

    def __init__(self, kube: Kubernetes) -> None:
        self.kube = kube
        self.api: KubeApi | None = None
        self.watches: dict[str, PodWatch] = {}
        self.runners: dict[tuple[str, str], Adopter] = {}
        """(deployment label, instance index) -> its runner."""
        self.found: Callable[[Adopter, str], None] | None = None
        """Told what became of a runner's engine unasked (``ready``: a pod taken up, which the
        lifecycle takes up as ready; ``stopped``: an unproven stop's pod gone at last)."""
        self.tasks = Supervisor("the pod watches")

    def watch(self, namespace: str) -> PodWatch | None:
        return self.watches.get(namespace)

    async def open(self, env: Mapping[str, str]) -> None:
        """Connect, start every namespace's watch, and take up what a previous run left."""
        self.api = api = await connect(self.kube, env)
        for ns in sorted({r.namespace for r in self.runners.values()}):
            w = self.watches[ns] = PodWatch(api, ns, selector(self.kube), self.kube.watch_timeout)
            self.tasks.spawn(w.run(), what=f"the pod watch of namespace {ns}")
        for ns, w in self.watches.items():
            try:
                await asyncio.wait_for(w.listed.wait(), CALL_TIMEOUT_S)
            except TimeoutError:
                logger.warning("pods in %s: not listed yet; none of them is taken up", ns)
                continue
            await self._take_up(api, w)

    def late(self, run: PodRun, runner: Adopter) -> None:
        """An unproven stop's pod: once it is gone at last (a lost node's comes back, or
        someone deletes it with force), the lifecycle hears the engine stopped, unless the
        instance runs again meanwhile (its memory is then counted as running anyway)."""

        async def wait() -> None:
            await run.gone()
            if runner.idle and self.found is not None:
                self.found(runner, "stopped")

        self.tasks.spawn(wait(), what=f"{runner.instance.where}: its pod's end")

    async def close(self) -> None:
        await self.tasks.aclose()
        if self.api is not None:
            await self.api.close()

    async def _take_up(self, api: KubeApi, w: PodWatch) -> None:
        for name, pod in list(w.pods.items()):
            labels = (pod.get("metadata") or {}).get("labels") or {}
            runner = self.runners.get((labels.get(DEPLOYMENT, ""), labels.get(INSTANCE, "")))
            fits = runner is not None and labels.get(SPEC) == runner.spec_hash
            if runner is not None and fits and serving(pod):
                runner.adopt(pod)
                logger.info("pod %s in %s: taken up as it runs", name, w.namespace)
                if self.found is not None:
                    self.found(runner, "ready")
                continue
            why = "its spec changed" if runner is not None else "no deployment names it"
            if runner is not None and fits:
                why = "it was not ready"
            logger.info("pod %s in %s: deleted (%s)", name, w.namespace, why)
            try:
                await api.delete(w.namespace, name, self.kube_grace(pod), uid_of(pod))
            except KubeError as exc:
                logger.warning("pod %s in %s could not be deleted: %s", name, w.namespace, exc)

    @staticmethod
    def kube_grace(pod: dict[str, Any]) -> int:
        return int((pod.get("spec") or {}).get("terminationGracePeriodSeconds") or 30)
