"""A pod's engine log as the console shows it: read from the API server (``pods/log``), masked
as a local engine's log is."""

from __future__ import annotations

from .._deployments.routes import EngineInstance
from .._log import masked, secrets_in
from .cluster import Cluster
from .kube import KubeError

__all__ = ["PodLog"]


class PodLog:
    """The engine's own log, read from the API server (``pods/log``), masked."""

    def __init__(self, cluster: Cluster, namespace: str, name: str, secrets: list[str]) -> None:
        self._cluster, self._ns, self._name, self.secrets = cluster, namespace, name, secrets

    @classmethod
    def of(cls, cluster: Cluster, namespace: str, name: str, inst: EngineInstance) -> PodLog:
        """The log of ``inst``'s pod ``name``, masking its engine's key and what its command
        line and environment hold."""
        launch = inst.launch
        found = secrets_in(list(launch.command), dict(launch.env)) if launch is not None else []
        return cls(cluster, namespace, name, [s for s in (inst.engine_key, *found) if s])

    async def lines(self, count: int, max_bytes: int) -> list[str]:
        try:
            text = await self._cluster.api.log(self._ns, self._name, count, max_bytes)
        except KubeError as exc:
            return [f"(the pod's log could not be read: {exc.reason})"]
        return [masked(line, self.secrets) for line in text.splitlines()[-count:]]
