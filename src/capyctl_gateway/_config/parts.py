"""The configuration's building blocks: durations and sizes as operators write them, the
configuration's error, and the small models of what the gateway runs (`Launch`, `Lifecycle`,
`Memory`, `Resources`)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from .._errors import OperatorError

__all__ = [
    "KEEPALIVE_TIMEOUT_S",
    "STRICT",
    "Bytes",
    "ConfigError",
    "EngineLogs",
    "Launch",
    "Lifecycle",
    "Memory",
    "Resources",
    "Routing",
    "Seconds",
]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class ConfigError(OperatorError):
    """The configuration cannot be used; the message names the key and the problem."""


def _seconds(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a duration such as 600s, not true or false")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        m = _DURATION.match(value)
        if m is None:
            raise ValueError(f"{value!r} is not a duration such as 600s, 2m or 500ms")
        return float(m.group(1)) * _UNITS[m.group(2)]
    return value


Seconds = Annotated[float, BeforeValidator(_seconds), Field(gt=0, allow_inf_nan=False)]
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$")
_SIZE_UNITS = {
    None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}  # fmt: skip


def _bytes(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a size such as 2GiB or 0, not true or false")
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m is None:
            raise ValueError(f"{value!r} is not a size such as 40GiB, 512MiB or 0")
        return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
    return value


Bytes = Annotated[int, BeforeValidator(_bytes), Field(ge=0)]


STRICT = ConfigDict(frozen=True, extra="forbid")
KEEPALIVE_TIMEOUT_S = 5.0
"""How long every listener keeps an idle keep-alive connection by default: as uvicorn and
llama-server do, above the 4 s the gateway's own engine pool keeps one (so a server never sends
on an ingress connection being closed), and short enough that idle clients free their slots."""


class Resources(BaseModel):
    model_config = STRICT

    memory_budget: Bytes | None = None
    """What launched deployments may hold at once (ready and parked); absent: no limit."""
    switching: Literal["cost_aware", "on_arrival", "collate"] = "cost_aware"
    """When a deployment is switched out for another that waits (``_scheduling/``):
    ``cost_aware`` keeps the resident one while its requests keep coming, up to what the
    switch costs and `max_switch_wait`; ``on_arrival`` switches as soon as a request arrives
    (the gateway before the scheduler); ``collate`` switches as soon as the resident one has
    nothing to do (llama-swap's collation, for comparison)."""
    max_switch_wait: Seconds = 30.0
    """The longest a request waits for its deployment because another is being kept in (the
    fairness bound of ``cost_aware``), before the switch itself."""
    switch_patience: float = Field(default=2.0, ge=0, le=100, allow_inf_nan=False)
    """How many times the switch's cost a request waits before a busy resident deployment is
    switched out for it (``cost_aware``)."""


class Memory(BaseModel):
    model_config = STRICT

    ready: Bytes
    parked: Bytes = 0


class Lifecycle(BaseModel):
    model_config = STRICT

    activation: Literal["on_request", "explicit", "always"] = "on_request"
    park: Literal["auto", "sleep", "stop"] = "auto"
    ready_idle_timeout: Seconds | None = None
    parked_idle_timeout: Seconds | None = None
    spare_idle_timeout: Seconds | None = None
    """Of a deployment of several launched instances, one that ran no request for this long
    while another is ready is parked alone (stopped, where a park is a stop), and woken when
    a request would wait longer behind the ready ones than its wake takes; absent: never."""
    drain_timeout: Seconds = 30.0
    unresponsive_timeout: Seconds = 30.0
    """A ready engine on this machine that answers none of the collector's polls for this long
    is stopped (its process group killed) and started again for the next request."""
    come_back: bool = False
    """Switched out to make room for another deployment, it starts again by itself once the
    memory budget has room for it (never switching another out for that)."""
    start_estimate: Seconds = 10.0
    """What a start (or a wake) of it costs until one is measured: what the scheduler weighs
    a switch to it by (``resources.switching: cost_aware``)."""
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    """Among deployments waiting for the same memory, the lower goes first (vLLM's
    convention); within the fairness bound."""
    warm_cache: bool = True
    """What the engine had cached is saved before it stops (a park, a switch, an idle or an
    operator's stop) and restored when it starts again, before it takes a request: launched
    llama.cpp servers (one model each). ``off`` turns it off."""
    warm_cache_disk: Bytes = 4 * 2**30
    """The disk the deployment's saved caches may hold, all its instances together."""
    warm_cache_timeout: Seconds = 30.0
    """How long the saves before a stop, or the restores after a start, may take in all; past
    it the rest is given up and the instance serves cold."""


class Routing(BaseModel):
    """How a deployment with several instances chooses one for a request: where its prefix is
    cached (``prefix``, the default) or the least loaded (``least_load``)."""

    model_config = STRICT

    policy: Literal["prefix", "least_load"] = "prefix"
    load_margin: int = Field(default=4, ge=0, le=10_000)
    """How many more requests (running and waiting) the instance with the longest cached prefix
    may have than the instance with the fewest, and still be chosen."""
    prefix_entries: int = Field(default=16_384, ge=16, le=1_048_576)
    """Prefix fingerprints the deployment's index keeps (one per 256 bytes of distinct prompt
    text, at most about 200 bytes of memory each, 24 more for each further instance holding
    one), least recently used out first."""


class EngineLogs(BaseModel):
    """How much of a launched engine's output is kept: each run writes files of its own, the
    oldest part of a run dropped past ``files`` of ``file_size``; the files of the last
    ``runs`` runs (the current one included) are kept. Default: 16 MiB x 3 x 4, at most
    192 MiB per instance."""

    model_config = STRICT

    file_size: Bytes = Field(default=16 * 2**20, ge=4096)
    files: int = Field(default=3, ge=1, le=100)
    runs: int = Field(default=4, ge=1, le=100)


class Launch(BaseModel):
    model_config = STRICT

    command: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    """Added to the gateway's environment."""
    startup_timeout: Seconds = 600.0
    logs: EngineLogs = EngineLogs()
