"""The registry of runner kinds: the one module that knows every room where an engine can run.

Each configured instance names its kind (`Instance.runner_kind`); `KINDS` maps the kind to a
`RunnerKind`: the factory that makes the instance's `Runner` from what the fleet opened
(`Opened`), and what must happen once before any engine of that kind starts (a previous run's
local engines outlasted; a cluster connected and a previous run's pods taken up). A kind is
one room, one line here and one configuration model; nothing else in the gateway asks where an
engine runs.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import aiohttp

from canopyx_provider import Collector

from ._config import Deployment, GatewayConfig, Instance
from ._deployments.routes import EngineInstance
from ._deployments.runner import Runner
from ._deployments.settle import Settlement
from ._local.pids import outlast
from ._local.runner import LocalRunner
from ._machines.runner import HostLink, HostRunner
from ._pods.cluster import Cluster
from ._pods.runner import PodRunner
from ._store import Store

__all__ = ["KINDS", "Hooks", "Opened", "RunnerKind", "host_links", "prepare", "runner_for"]


@dataclass(slots=True)
class Hooks:
    """What runners may tell the lifecycle, once it exists (set before `prepare`)."""

    found: Callable[[EngineInstance, str, str | None], None] | None = None
    """An engine found running without this gateway starting it (a previous run's pod)."""


@dataclass(frozen=True, slots=True)
class Opened:
    """What the fleet has opened that a runner may use."""

    config: GatewayConfig
    collector: Collector
    session: aiohttp.ClientSession
    settlement: Settlement
    log_dir: Path
    clock: Callable[[], float]
    """The settlement's and the collector's clock (wall time)."""
    loop_time: Callable[[], float]
    store: Store | None
    env: Mapping[str, str] = field(default_factory=dict)
    """The gateway's environment (where the cluster's credentials may be named)."""
    stack: contextlib.AsyncExitStack | None = None
    """Where a kind closes what it opened, after the lifecycle has stopped its engines."""
    hooks: Hooks = field(default_factory=Hooks)
    links: dict[str, HostLink] = field(default_factory=dict)
    """The server role's links to its hosts, one per host (empty elsewhere)."""
    clusters: dict[str, Cluster] = field(default_factory=dict)
    """The cluster of the pods (one at most, under ``kubernetes``)."""
    faults: Counter[str] = field(default_factory=Counter)
    """Where defects in a kind's own background tasks are counted (the lifecycle's count)."""


@dataclass(frozen=True, slots=True)
class RunnerKind:
    make: Callable[[EngineInstance, Instance, Opened], Runner]
    prepare: Callable[[Opened], Awaitable[None]] | None = None
    """Once, before any engine of this kind can start."""


def _deployment(inst: EngineInstance, o: Opened) -> Deployment:
    dep = o.config.deployment(inst.deployment)
    if dep is None:
        raise AssertionError(f"{inst.where} was built from no deployment")
    return dep


def _local(inst: EngineInstance, configured: Instance, o: Opened) -> Runner:
    dep = _deployment(inst, o)
    return LocalRunner(
        inst,
        dep,
        collector=o.collector,
        session=o.session,
        log_dir=o.log_dir,
        clock=o.clock,
        store=o.store,
    )


async def _outlast(o: Opened) -> None:
    if o.store is not None:  # a previous run's engines go before this one starts any
        await outlast(o.store)


def _host(inst: EngineInstance, configured: Instance, o: Opened) -> Runner:
    name = configured.host or ""
    link = o.links.setdefault(name, HostLink(name))
    return HostRunner(inst, link, o.settlement, loop_time=o.loop_time)


def _pod(inst: EngineInstance, configured: Instance, o: Opened) -> Runner:
    dep = _deployment(inst, o)
    cluster = o.clusters.get("kubernetes")
    if cluster is None:
        cluster = o.clusters["kubernetes"] = Cluster(o.config.kubernetes, faults=o.faults)
    if configured.pod is None:
        raise AssertionError("a pod instance without its pod")
    return PodRunner(
        inst,
        dep,
        configured.pod,
        cluster,
        collector=o.collector,
        session=o.session,
        clock=o.clock,
    )


async def _open_cluster(o: Opened) -> None:
    cluster = o.clusters.get("kubernetes")
    if cluster is None:
        return
    found = o.hooks.found
    if found is not None:
        cluster.found = lambda r, state: found(r.instance, state, None)
    if o.stack is not None:
        o.stack.push_async_callback(cluster.close)
    await cluster.open(o.env)


KINDS: MappingProxyType[str, RunnerKind] = MappingProxyType(
    {
        "local": RunnerKind(_local, prepare=_outlast),
        "host": RunnerKind(_host),
        "pod": RunnerKind(_pod, prepare=_open_cluster),
    }
)


def runner_for(
    opened: Opened, kinds: Mapping[str, RunnerKind] = KINDS
) -> Callable[[EngineInstance, Instance], Runner]:
    """What `build_routes` calls for each built instance (``kinds``: a test's own registry)."""

    def make(inst: EngineInstance, configured: Instance) -> Runner:
        return kinds[configured.runner_kind].make(inst, configured, opened)

    return make


async def prepare(opened: Opened, kinds: Mapping[str, RunnerKind] = KINDS) -> None:
    """Each kind's preparation, once, before any engine starts."""
    for kind in kinds.values():
        if kind.prepare is not None:
            await kind.prepare(opened)


def host_links(opened: Opened, hosts: set[str]) -> dict[str, HostLink]:
    """The server role's link to each of ``hosts`` (those its instances made, and the rest)."""
    for name in sorted(hosts):
        opened.links.setdefault(name, HostLink(name))
    return opened.links
