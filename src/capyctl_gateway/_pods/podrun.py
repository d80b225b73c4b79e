"""One run of an instance's engine: the pod one start created (or one taken up), known by its
name and uid, as its namespace's watch last said, until its deletion is proven."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .._errors import StartFailedError
from .cluster import Cluster
from .kube import KubeError
from .podstate import ended, terminating
from .watch import uid_of

__all__ = ["STOP_PROOF_MARGIN_S", "PodRun"]

logger = logging.getLogger("capyctl_gateway")

STOP_PROOF_MARGIN_S = 30.0
"""How long past its grace period a deleted pod may take to be gone before its stop counts as
unproven (its cut requests then stay counted)."""


class PodRun:
    """This run's pod."""

    def __init__(self, cluster: Cluster, namespace: str, name: str, uid: str) -> None:
        self.cluster, self.namespace, self.name, self.uid = cluster, namespace, name, uid
        self.stopping = False
        """The gateway deletes it: its end is no exit."""

    @classmethod
    async def create(cls, cluster: Cluster, body: dict[str, Any], where: str) -> PodRun:
        """Create the pod ``body``; its run. Raises StartFailedError, saying whether the API
        could not be reached or refused it (its reason; the whole message is logged)."""
        meta = body["metadata"]
        if cluster.api is None:
            raise StartFailedError("the Kubernetes API was not reached when the gateway started")
        try:
            made = await cluster.api.create(meta["namespace"], body)
        except KubeError as exc:
            logger.error("%s: its pod was not created: %s", where, exc)
            if exc.status == 0:
                raise StartFailedError("the Kubernetes API could not be reached") from None
            raise StartFailedError(f"Kubernetes refused its pod ({exc.reason})") from None
        return cls(cluster, meta["namespace"], str(meta["name"]), uid_of(made))

    def pod(self) -> dict[str, Any] | None:
        """The pod as the watch last said (None once it is gone)."""
        w = self.cluster.watch(self.namespace)
        pod = w.pods.get(self.name) if w is not None else None
        return pod if pod is not None and uid_of(pod) == self.uid else None

    def exited(self) -> str | None:
        """Why its engine is gone unasked; None while it may run, or once it is being stopped."""
        if self.stopping:
            return None
        w = self.cluster.watch(self.namespace)
        pod = self.pod()
        if pod is None:  # only a watch that runs says so: a dropped one says nothing
            current = w is not None and w.current
            return f"its pod {self.name} was deleted" if current else None
        if (why := ended(pod)) is not None:
            return why
        if terminating(pod):
            return f"Kubernetes is deleting its pod {self.name} (evicted, or its node lost)"
        return None

    async def gone(self) -> None:
        """Return once the watch no longer has it."""
        w = self.cluster.watch(self.namespace)
        while w is not None and (self.pod() is not None or not w.listed.is_set()):
            await w.changed()

    async def delete(self, grace_s: int, where: str) -> bool:
        """Delete it; whether it is proven gone: a 404, or the watch no longer has it (its
        DELETED event, or a list without it) within its grace period and a margin."""
        api, w = self.cluster.api, self.cluster.watch(self.namespace)
        if api is None or w is None:
            return False
        self.stopping = True
        try:
            if await api.delete(self.namespace, self.name, grace_s, self.uid) is None:
                return True  # 404: not there
        except KubeError as exc:
            if exc.status != 409:  # 409: the name has another uid now: ours is gone
                logger.warning("%s: its pod %s was not deleted: %s", where, self.name, exc)
                return False
        try:
            async with asyncio.timeout(grace_s + STOP_PROOF_MARGIN_S):
                await self.gone()
        except TimeoutError:
            logger.warning("%s: its pod %s is not gone yet", where, self.name)
            return False
        return True
