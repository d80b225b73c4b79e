"""This gateway's pods on its cluster: the API's client, one watch per namespace (``watch.py``),
the deletes it owes (``deletes.py``), and the pod runners that read them.

Made by the pods' room (``room.py``) before any runner, connected with the operator's
credentials, its namespaces' watches running from then on in its own supervisor until the
fleet closes (after the lifecycle has stopped what it stops). Once the lifecycle exists it takes
up what a previous run left (`Cluster.take_up`): a ready pod whose labels name a configured
instance and whose spec hash is the configuration's is adopted (the lifecycle hears it found
ready, as a host's engine is found), one per instance; every other pod of the owner is owed
its delete.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._config import Kubernetes
from .._deployments.routes import EngineInstance
from .._tasks import Supervisor
from .deletes import Debt
from .kube import CALL_TIMEOUT_S, KubeApi
from .manifest import DEPLOYMENT, INSTANCE, SPEC, selector
from .podstate import serving
from .watch import PodWatch, uid_of

if TYPE_CHECKING:
    from .podrun import PodRun

__all__ = ["Adopter", "Cluster"]

logger = logging.getLogger("capyctl_gateway")

WATCH_AGAIN_S = 1.0
"""The least a pod watch waits before it runs again after a defect stopped it (the
supervisor's backoff doubles it while defects follow each other)."""
DEFECT = "an internal error in the gateway (logged with its traceback)"


class Adopter(Protocol):
    """A pod runner, as the cluster takes up a previous run's pods for it."""

    instance: EngineInstance
    namespace: str
    spec_hash: str
    grace_s: int

    @property
    def idle(self) -> bool: ...

    def adopt(self, pod: dict[str, Any]) -> None: ...


class Cluster:
    """The gateway's pods on one cluster."""

    def __init__(
        self,
        kube: Kubernetes,
        api: KubeApi,
        namespaces: set[str],
        *,
        faults: Counter[str] | None = None,
    ) -> None:
        """The cluster that ``api`` reaches, its pods in ``namespaces`` watched from now on;
        ``faults``: where defects in its watches and deletes are counted."""
        self.kube, self.api = kube, api
        self.runners: dict[tuple[str, str], Adopter] = {}
        """(deployment label, instance index) -> its runner (the pod room keeps it)."""
        self.found: Callable[[Adopter, str], None] = _unheard
        """Told what became of a runner's engine unasked (``ready``: a pod taken up, which the
        lifecycle takes up as ready; ``stopped``: an unproven stop's pod gone at last), once
        the lifecycle hears (`take_up`)."""
        self.debts: dict[tuple[str, str], Debt] = {}
        """(namespace, pod name) -> the delete owed for it."""
        self.tasks = Supervisor("the pods", faults=faults)
        self.watches: dict[str, PodWatch] = {}
        for ns in sorted(namespaces):
            w = self.watches[ns] = PodWatch(api, ns, selector(kube), kube.watch_timeout)
            self._keep(w)

    def watch(self, namespace: str) -> PodWatch | None:
        return self.watches.get(namespace)

    async def take_up(self, found: Callable[[Adopter, str], None]) -> None:
        """Tell ``found`` from now on, and take up what a previous run left (each namespace
        waited for until it is listed, within `CALL_TIMEOUT_S`)."""
        self.found = found
        for ns, w in self.watches.items():
            try:
                await asyncio.wait_for(w.listed.wait(), CALL_TIMEOUT_S)
            except TimeoutError:
                logger.warning("pods in %s: not listed yet; none of them is taken up", ns)
                continue
            await _take_up(self, w)

    def _keep(self, w: PodWatch) -> None:
        """Run ``w`` for as long as the cluster is open: a defect in it is logged and counted,
        the watch is down meanwhile, and it runs again after the supervisor's backoff."""
        what = f"the pod watch of namespace {w.namespace}"

        async def turn() -> None:
            try:
                await w.run()
            finally:  # a defect, or the cluster closing: what it said is no longer current
                w.down(f"the watch stopped: {DEFECT}")

        self.tasks.keep(turn, every=WATCH_AGAIN_S, first=0.0, kind="pod_watch", what=what)

    def owe(
        self,
        run: PodRun,
        owner: str,
        why: str,
        *,
        grace_s: int,
        runner: Adopter | None = None,
        tried: bool = True,
    ) -> Debt:
        """Owe ``run``'s pod a delete (see ``deletes.py``) for ``why``, tried again until it is
        gone (at once unless a try just failed: ``tried``); ``runner``, whose pod it is, hears
        it stopped once it is gone, if nothing of its runs meanwhile."""
        key = (run.namespace, run.name)
        if (debt := self.debts.get(key)) is not None:
            return debt
        debt = self.debts[key] = Debt(run, owner, why, grace_s, failed=int(tried))
        logger.warning(
            "%s: the delete of its pod %s is owed (%s); tried again until it is gone",
            owner,
            run.name,
            why,
        )

        async def turn() -> bool:
            if not await debt.turn():
                return False
            del self.debts[key]
            debt.paid.set()
            logger.info("%s: its pod %s is gone (%d tries)", owner, run.name, debt.tries)
            if runner is not None and runner.idle:
                self.found(runner, "stopped")
            return True

        what = f"{owner}: deleting its pod {run.name}"
        self.tasks.keep(turn, every=0.0, first=0.0, kind="pod_delete", what=what)
        return debt

    def owed_by(self, owner: str) -> list[Debt]:
        """The deletes owed for ``owner``'s pods."""
        return [d for d in self.debts.values() if d.owner == owner]

    async def close(self) -> None:
        await self.tasks.aclose()
        await self.api.close()

    @staticmethod
    def kube_grace(pod: dict[str, Any]) -> int:
        return int((pod.get("spec") or {}).get("terminationGracePeriodSeconds") or 30)


def _unheard(runner: Adopter, state: str) -> None:
    """What the cluster tells before the lifecycle hears: nothing (no engine starts before)."""


async def _take_up(cluster: Cluster, w: PodWatch) -> None:
    """Take up one serving pod per instance that a previous run left (its spec the
    configuration's); owe every other pod of the owner its delete."""
    from .podrun import PodRun  # its module reads this one

    taken: set[Adopter] = set()
    for name, pod in sorted(w.pods.items()):
        labels = (pod.get("metadata") or {}).get("labels") or {}
        runner = cluster.runners.get((labels.get(DEPLOYMENT, ""), labels.get(INSTANCE, "")))
        fits = runner is not None and labels.get(SPEC) == runner.spec_hash
        if runner is not None and fits and serving(pod) and runner not in taken:
            taken.add(runner)
            runner.adopt(pod)
            logger.info("pod %s in %s: taken up as it runs", name, w.namespace)
            cluster.found(runner, "ready")
            continue
        why = "its spec changed" if runner is not None else "no deployment names it"
        if runner is not None and fits:
            why = "another pod of its instance runs" if runner in taken else "not ready"
        run = PodRun(cluster, w.namespace, name, uid_of(pod))
        owner = runner.instance.where if runner is not None else f"pod {name} in {w.namespace}"
        grace = runner.grace_s if runner is not None else cluster.kube_grace(pod)
        cluster.owe(
            run,
            owner,
            f"a previous run's pod: {why}",
            grace_s=grace,
            runner=runner,
            tried=False,
        )
