"""The registry of runner kinds: the one module that knows every room where an engine can run.

`KINDS` maps each kind's name to its `RunnerKind`: which configured instances it runs
(``claims``, asked in the registry's order, the first that claims one runs it) and how its room
is opened (``open``: once per fleet, before any runner is made, and only where the
configuration has an instance of that kind). An opened room is a `Room`: it makes the runners
of its kind whole (it keeps what they share: this machine's engine records, a host's link, a
cluster's watches), and once the lifecycle exists it takes up what a previous run left and
reports to the lifecycle from then on (`Room.take_up`).

A kind is its room (with its `Room` and its runner), one line here, and its configuration
model; nothing else in the gateway asks where an engine runs (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType

from ._config import Instance
from ._deployments.kinds import Found, Opened, Room
from ._deployments.routes import EngineInstance
from ._deployments.runner import Runner
from ._local.room import LocalRoom
from ._machines.room import HostRoom
from ._machines.runner import HostLink
from ._pods.room import PodRoom

__all__ = [
    "KINDS",
    "Found",
    "Opened",
    "Room",
    "RunnerKind",
    "host_links",
    "kind_of",
    "open_rooms",
    "runner_for",
]


@dataclass(frozen=True, slots=True)
class RunnerKind:
    claims: Callable[[Instance], bool]
    """Whether it runs a configured instance (asked in the registry's order)."""
    open: Callable[[Opened], Awaitable[Room]]


KINDS: MappingProxyType[str, RunnerKind] = MappingProxyType(
    {
        "pod": RunnerKind(lambda i: i.pod is not None, PodRoom.open),
        "host": RunnerKind(lambda i: i.host is not None, HostRoom.open),
        "local": RunnerKind(lambda i: True, LocalRoom.open),
    }
)


def kind_of(configured: Instance, kinds: Mapping[str, RunnerKind] = KINDS) -> str:
    """The name of the kind that runs ``configured``."""
    return next(name for name, kind in kinds.items() if kind.claims(configured))


async def open_rooms(opened: Opened, kinds: Mapping[str, RunnerKind] = KINDS) -> dict[str, Room]:
    """The room of each kind the configuration has an instance of (``kinds``: a test's own
    registry), opened in the registry's order."""
    wanted = {kind_of(i, kinds) for d in opened.config.deployments for i in d.instances}
    if opened.config.hosts:  # a server's hosts have their links, instances or not
        wanted.add("host")
    return {name: await kind.open(opened) for name, kind in kinds.items() if name in wanted}


def runner_for(
    rooms: Mapping[str, Room], kinds: Mapping[str, RunnerKind] = KINDS
) -> Callable[[Instance], Callable[[EngineInstance], Runner]]:
    """What `build_routes` asks for each configured instance: what makes its runner (its
    kind's room, given the instance as it is built)."""

    def of(configured: Instance) -> Callable[[EngineInstance], Runner]:
        return partial(rooms[kind_of(configured, kinds)].runner, configured=configured)

    return of


def host_links(rooms: Mapping[str, Room]) -> dict[str, HostLink]:
    """The server's link to each of its hosts (none without a host room)."""
    hosts = rooms.get("host")
    return hosts.links if isinstance(hosts, HostRoom) else {}
