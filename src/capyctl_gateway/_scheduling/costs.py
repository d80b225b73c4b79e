"""What switching a deployment in or out costs, as the lifecycle measured it: each instance's
last start (``starting`` to ``ready``), wake (``waking`` to ``ready``), park (``parking`` to
``parked``) and stop (``stopping`` to ``stopped``), and each deployment's last drain (a closing's
wait for its running requests; a closing with none running measures no drain). Until a start
or wake has been measured, the deployment's ``lifecycle.start_estimate`` stands in for it; a
park, a stop or a drain not measured yet costs nothing."""

from __future__ import annotations

from .._lifecycle.states import DeploymentLife, InstanceState, Launched

__all__ = ["Costs"]

_MEASURED = {
    (InstanceState.STARTING, InstanceState.READY): "start",
    (InstanceState.WAKING, InstanceState.READY): "wake",
    (InstanceState.PARKING, InstanceState.PARKED): "park",
    (InstanceState.STOPPING, InstanceState.STOPPED): "stop",
}


class Costs:
    """The last measured time of each kind of transition, per deployment."""

    def __init__(self) -> None:
        self.last: dict[tuple[str, str], float] = {}
        """(deployment, start|wake|park|stop|drain) -> seconds it last took."""
        self.spent: dict[tuple[str, str], float] = {}
        """(deployment, starting|waking|parking|stopping|draining) -> seconds spent in all."""
        self._entered: dict[Launched, tuple[InstanceState, float]] = {}

    def __call__(self, lc: Launched) -> None:
        """A transition observer: measure the transition ``lc`` just ended."""
        before = self._entered.get(lc)
        self._entered[lc] = (lc.state, lc.since)
        if before is None:
            return
        took = max(lc.since - before[1], 0.0)
        name = lc.inst.deployment
        if (what := _MEASURED.get((before[0], lc.state))) is not None:
            self.last[(name, what)] = took
        if before[0] in _SPENT:
            key = (name, before[0].value)
            self.spent[key] = self.spent.get(key, 0.0) + took

    def drained(self, life: DeploymentLife, took: float) -> None:
        """A closing of ``life`` waited ``took`` seconds for its running requests."""
        name = life.deployment.name
        self.last[(name, "drain")] = took
        self.spent[(name, "draining")] = self.spent.get((name, "draining"), 0.0) + took

    def start(self, life: DeploymentLife) -> float:
        """What starting an instance of ``life`` costs (the estimate until measured)."""
        name = life.deployment.name
        return self.last.get((name, "start"), life.deployment.lifecycle.start_estimate)

    def up(self, life: DeploymentLife) -> float:
        """What bringing ``life`` in costs now: a wake where an instance is parked, else a
        start (the estimate until measured)."""
        start = self.start(life)
        if any(lc.state is InstanceState.PARKED for lc in life.launched):
            return self.last.get((life.deployment.name, "wake"), start)
        return start

    def back(self, life: DeploymentLife) -> float:
        """What bringing ``life`` back costs once taken out: a wake where it parks, else a
        start (the estimate until measured)."""
        start = self.start(life)
        return self.last.get((life.deployment.name, "wake"), start) if life.parks else start

    def down(self, life: DeploymentLife) -> float:
        """What taking ``life`` out costs: its drain (while a request runs), then its park or
        stop, as last measured."""
        name = life.deployment.name
        rest = self.last.get((name, "park" if life.parks else "stop"), 0.0)
        drain = self.last.get((name, "drain"), 0.0) if life.route.queue.running else 0.0
        return drain + rest

    def switch(self, out: DeploymentLife, into: DeploymentLife) -> float:
        """What switching ``out`` for ``into`` costs."""
        return self.down(out) + self.up(into)


_SPENT = (
    InstanceState.STARTING,
    InstanceState.WAKING,
    InstanceState.PARKING,
    InstanceState.STOPPING,
)
