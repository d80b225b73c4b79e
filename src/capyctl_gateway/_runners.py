"""The registry of runner kinds: the one module that knows every room where an engine can run.

Each configured instance names its kind (`Instance.runner_kind`); `KINDS` maps the kind to a
`RunnerKind`: the factory that makes the instance's `Runner` from what the fleet opened
(`Opened`), and what must happen once before any engine of that kind starts (a previous run's
local engines outlasted). Adding a kind (a pod, say) is one room, one line here and one
configuration model; nothing else in the gateway asks where an engine runs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import aiohttp

from canopyx_provider import Collector

from ._config import GatewayConfig, Instance
from ._deployments.routes import EngineInstance
from ._deployments.runner import Runner
from ._deployments.settle import Settlement
from ._local.pids import outlast
from ._local.runner import LocalRunner
from ._machines.runner import HostLink, HostRunner
from ._store import Store

__all__ = ["KINDS", "Opened", "RunnerKind", "host_links", "prepare", "runner_for"]


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
    links: dict[str, HostLink] = field(default_factory=dict)
    """The server role's links to its hosts, one per host (empty elsewhere)."""


@dataclass(frozen=True, slots=True)
class RunnerKind:
    make: Callable[[EngineInstance, Instance, Opened], Runner]
    prepare: Callable[[Opened], Awaitable[None]] | None = None
    """Once, before any engine of this kind can start."""


def _local(inst: EngineInstance, configured: Instance, o: Opened) -> Runner:
    dep = next(d for d in o.config.deployments if d.name == inst.deployment)
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


KINDS: MappingProxyType[str, RunnerKind] = MappingProxyType(
    {
        "local": RunnerKind(_local, prepare=_outlast),
        "host": RunnerKind(_host),
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
