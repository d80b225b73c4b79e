"""Deployments as the gateway serves them: their instances, queue and instance choice.

A `Route` is one deployment: its instances, its waiting queue, and the choice of the
instance a request is offered to. Load is the engine's own count of running and waiting
requests when a fresh sample has it, and never less than the requests the gateway has in
flight there. Cut requests still waiting to be settled are not load: they say what the engine
may still be doing and what memory stays counted, and an instance whose clients gave up early
must not be starved of traffic for it.

Never imports the HTTP surface or the relay.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from yarl import URL

from canopyx_provider import CheckReport

from .._config import ConfigError, Deployment, GatewayConfig, Instance, Launch
from .._engines import facts
from .queue import Admission, DeploymentQueue
from .settle import InstanceLedger, Settlement

__all__ = [
    "EngineInstance",
    "Route",
    "build_routes",
    "same_version",
    "unusable_reason",
    "usage_penalty",
]

ENGINE_HEADERS = {
    "Content-Type": "application/json",
    "Accept": "text/event-stream",
    # The stream is parsed as it comes: the engine must not compress it.
    "Accept-Encoding": "identity",
    # Ours, so that aiohttp adds none of its own (and skips work doing so).
    "User-Agent": "capyctl-gateway",
}


@dataclass(eq=False)
class EngineInstance:
    """One engine serving a deployment, as the gateway reaches it."""

    deployment: str
    index: int
    url: str | None
    """None while a launched engine has no process (its address comes with its port)."""
    headers: dict[str, str] = field(repr=False)
    engine_key: str | None = field(repr=False)
    ledger: InstanceLedger
    launch: Launch | None = None
    """How the gateway runs it; None for an engine someone else runs."""
    host: str = field(init=False, default="")
    where: str = field(init=False, default="")
    """How clients hear of it: never its address."""
    chat_url: URL = field(init=False, default=URL())
    decision_url: URL = field(init=False, default=URL())
    unusable: str | None = None
    """Why requests are not sent here (a startup check the engine failed: another model
    served, another version refused); None while it may be routed to."""
    available: bool = field(init=False, default=True)
    """Whether the engine can take requests now (a launched one: only while ready; a remote
    one: while its host's session is live and its gate open)."""
    remote: str | None = None
    """The host machine it runs on (the server role); None when this process reaches it."""
    gate_open: bool = field(init=False, default=False)
    """A remote instance's host reported it taking requests (its gate key in the headers)."""
    exchanges: set[Any] = field(init=False, default_factory=set)
    """A remote instance's exchanges in progress (ended at once when its host goes away)."""

    def __post_init__(self) -> None:
        self.where = f"deployment {self.deployment}, instance {self.index}"
        self.available = self.launch is None and self.remote is None
        if self.url is not None and self.remote is None:
            self.bind(self.url)
        if self.remote is not None:
            self.url, self.host = None, self.remote

    def bind(self, url: str) -> None:
        """Address the instance at ``url`` (a launched engine, once it has its port; a remote
        one, at its host's ingress)."""
        self.url = url
        self.host = self.remote or urlsplit(url).hostname or ""
        # Parsed once: aiohttp would parse a string URL on every request.
        self.chat_url = URL(url + "/v1/chat/completions")
        self.decision_url = URL(url + "/v1/systemone")

    @property
    def key(self) -> str:
        """The collector's and the ledger's key: ``<deployment>/<index>``."""
        return self.ledger.key


@dataclass(eq=False)
class Route:
    deployment: Deployment
    instances: list[EngineInstance]
    queue: DeploymentQueue
    turn: itertools.count[int] = field(default_factory=itertools.count)
    _changed: asyncio.Event | None = None

    def notify(self) -> None:
        """An instance became available: requests waiting for one look again."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def available(self, within: float) -> bool:
        """Wait up to ``within`` seconds for an instance to become available; whether one did."""
        if self._changed is None:
            self._changed = asyncio.Event()
        try:
            await asyncio.wait_for(self._changed.wait(), max(within, 0))
        except TimeoutError:
            return False
        return True

    def choose(
        self,
        load: Callable[[EngineInstance], int],
        exclude: set[int] | frozenset[int] = frozenset(),
    ) -> EngineInstance | None:
        """The least loaded usable instance among those not excluded; ties rotate."""
        if len(self.instances) == 1:
            only = self.instances[0]
            return None if only.index in exclude or only.unusable or not only.available else only
        start = next(self.turn) % len(self.instances)
        ordered = [
            i
            for i in self.instances[start:] + self.instances[:start]
            if i.index not in exclude and not i.unusable and i.available
        ]
        return min(ordered, key=load) if ordered else None


def usage_penalty(usage: float | None) -> int:
    """What a nearly full KV cache (or slot set) adds to an instance's load: up to 8 from 80%."""
    if usage is None or usage <= 0.8:
        return 0
    return math.ceil((min(usage, 1.0) - 0.8) / 0.2 * 8)


def unusable_reason(deployment: Deployment, report: CheckReport) -> str | None:
    """Why an instance whose startup checks ended with ``report`` must not be routed to.

    An engine that is down or slow (health, discovery, metrics) is still offered requests: a
    refused connection moves them to the next instance, and the metrics are the SDK's concern,
    not the answers'. One that answers but does not serve the model would answer every request
    wrongly.
    """
    failed = report.failed
    if failed is not None and failed.name == "models":
        return f"{failed.name} check failed: {failed.reason}"
    reported = report.engine_version
    if (
        deployment.version_mismatch == "refuse"
        and reported is not None
        and not same_version(reported, deployment.engine_version)
    ):
        return (
            f"the engine reports version {reported}, not engine_version "
            f"{deployment.engine_version} (version_mismatch: refuse)"
        )
    return None


def same_version(reported: str, configured: str) -> bool:
    return reported.strip().lower().removeprefix("v") == configured.strip().lower().removeprefix(
        "v"
    )


def _engine_key(instance: Instance, env: Mapping[str, str]) -> str | None:
    if instance.api_key_env is None:
        return None
    key = env.get(instance.api_key_env)
    if not key:
        where = instance.url or "launched"
        raise ConfigError(f"instance {where}: api_key_env {instance.api_key_env} is not set")
    return key


def build_routes(
    config: GatewayConfig, env: Mapping[str, str], settlement: Settlement
) -> dict[str, Route]:
    """One route per deployment; raises ConfigError for an engine key that is not set."""
    admission = Admission(config.queue.max_waiting_total)
    routes: dict[str, Route] = {}
    for d in config.deployments:
        instances = []
        for i, inst in enumerate(d.instances):
            key = _engine_key(inst, env) if inst.host is None else None  # read on the host
            headers = dict(ENGINE_HEADERS)
            if key is not None:
                headers["Authorization"] = f"Bearer {key}"
            if facts(d.engine).closes_after_stream:
                headers["Connection"] = "close"  # so the connection is never reused
            ledger = settlement.ledger(f"{d.name}/{i}")
            instances.append(
                EngineInstance(
                    d.name,
                    i,
                    inst.url,
                    headers,
                    key,
                    ledger,
                    launch=inst.launch,
                    remote=inst.host,
                )  # fmt: skip
            )
        queue = DeploymentQueue(
            admission,
            max_running=config.queue.max_running_per_deployment,
            max_waiting=config.queue.max_waiting_per_deployment,
        )
        routes[d.name] = Route(d, instances, queue)
    return routes
