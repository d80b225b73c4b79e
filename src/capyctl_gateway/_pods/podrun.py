"""One run of an instance's engine: the pod one start created (``creating.py``) or one taken up,
known by its name and uid (or by its name alone, for a pod a create may have made without
saying so), as its namespace's watch last said, until its deletion is proven."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .cluster import Cluster
from .kube import KubeError
from .podstate import ended, terminating
from .watch import uid_of

__all__ = ["STOP_PROOF_MARGIN_S", "PodRun"]

logger = logging.getLogger("capyctl_gateway")

STOP_PROOF_MARGIN_S = 30.0
"""How long past its grace period a deleted pod may take to be gone before its stop counts as
unproven (its cut requests then stay counted, and its delete is owed)."""


class PodRun:
    """This run's pod (``uid`` None: a pod whose create was never answered, known by name)."""

    def __init__(self, cluster: Cluster, namespace: str, name: str, uid: str | None) -> None:
        self.cluster, self.namespace, self.name, self.uid = cluster, namespace, name, uid
        self.stopping = False
        """The gateway deletes it: its end is no exit."""

    def mine(self, pod: dict[str, Any]) -> bool:
        """Whether ``pod`` (of this name) is this run's."""
        return self.uid is None or uid_of(pod) == self.uid

    def pod(self) -> dict[str, Any] | None:
        """The pod as the watch last said (None once it is gone)."""
        w = self.cluster.watch(self.namespace)
        pod = w.pods.get(self.name) if w is not None else None
        return pod if pod is not None and self.mine(pod) else None

    def gone_now(self) -> bool:
        """Whether a watch that runs says it is gone."""
        w = self.cluster.watch(self.namespace)
        return w is not None and w.current and self.pod() is None

    def exited(self) -> str | None:
        """Why its engine is gone unasked; None while it may run, or once it is being stopped."""
        if self.stopping:
            return None
        pod = self.pod()
        if pod is None:  # only a watch that runs says so: a dropped one says nothing
            return f"its pod {self.name} was deleted" if self.gone_now() else None
        if (why := ended(pod)) is not None:
            return why
        if terminating(pod):
            return f"Kubernetes is deleting its pod {self.name} (evicted, or its node lost)"
        return None

    async def gone(self) -> None:
        """Return once a watch that runs no longer has it."""
        w = self.cluster.watch(self.namespace)
        while w is not None and not self.gone_now():
            await w.changed()

    async def delete(self, grace_s: int) -> str | None:
        """Delete it once; None once it is proven gone (a 404, a 409: the name has another uid
        now, or the watch no longer has it within its grace period and a margin; one known by
        name alone, only by a 404), else why it is not (the API's reason, never its address)."""
        api, w = self.cluster.api, self.cluster.watch(self.namespace)
        if w is None:
            return "its namespace is not watched"
        self.stopping = True
        try:
            if await api.delete(self.namespace, self.name, grace_s, self.uid) is None:
                return None  # 404: not there
        except KubeError as exc:
            if exc.status == 409 and self.uid is not None:  # the name has another uid now
                return None
            return f"its delete failed ({exc.reason})"
        if self.uid is None:  # the watch may never have had it: only a 404 proves it gone
            return "deleted; not yet answered 404"
        try:
            async with asyncio.timeout(grace_s + STOP_PROOF_MARGIN_S):
                await self.gone()
        except TimeoutError:
            return f"still there {grace_s + STOP_PROOF_MARGIN_S:.0f} s after its delete"
        return None
