"""Pods as a runner kind, as the registry opens it (``_runners.py``): the cluster, connected with
the operator's credentials and its namespaces watched before any runner is made, and a pod
runner per instance, kept by the cluster (which takes up a previous run's pods for them)."""

from __future__ import annotations

from .._config import Instance
from .._deployments.kinds import Found, Opened
from .._deployments.routes import EngineInstance
from .cluster import Adopter, Cluster
from .kube import connect
from .manifest import DEPLOYMENT, INSTANCE
from .runner import PodRunner

__all__ = ["PodRoom"]


class PodRoom:
    """The gateway's pods on its cluster."""

    def __init__(self, opened: Opened, cluster: Cluster) -> None:
        self._opened, self.cluster = opened, cluster

    @classmethod
    async def open(cls, opened: Opened) -> PodRoom:
        """Connect (raises OperatorError without credentials) and watch every namespace the
        configuration's pods go to; the cluster closes with the fleet, after the lifecycle."""
        kube = opened.config.kubernetes
        namespaces = {
            i.pod.namespace or kube.namespace
            for d in opened.config.deployments
            for i in d.instances
            if i.pod is not None
        }
        api = await connect(kube, opened.env)
        cluster = Cluster(kube, api, namespaces, faults=opened.faults)
        opened.stack.push_async_callback(cluster.close)
        return cls(opened, cluster)

    def runner(self, inst: EngineInstance, configured: Instance) -> PodRunner:
        if configured.pod is None:
            raise AssertionError(f"{inst.where}: a pod instance without its pod")
        o = self._opened
        runner = PodRunner(
            inst,
            o.deployment(inst),
            configured.pod,
            self.cluster,
            collector=o.collector,
            session=o.session,
            clock=o.clock,
        )
        labels = runner.labels
        self.cluster.runners[(labels[DEPLOYMENT], labels[INSTANCE])] = runner
        return runner

    async def take_up(self, found: Found) -> None:
        def told(runner: Adopter, state: str) -> None:
            found(runner.instance, state, None)

        await self.cluster.take_up(told)
