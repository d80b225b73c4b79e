"""The gateway's YAML configuration, validated on load; unknown keys are refused."""

from __future__ import annotations

import re
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from canopyx_provider import CanopyxError, EngineKind
from canopyx_provider.adapters import origin

from ._engines import FACTS, launch_problem
from ._errors import OperatorError

__all__ = [
    "Api",
    "HOST_NAME",
    "REMOTE_MAX_BODY_BYTES",
    "ConfigError",
    "Deployment",
    "GatewayConfig",
    "Instance",
    "QueueConfig",
    "load_config",
]

HOST_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
REMOTE_MAX_BODY_BYTES = 8 * 1024 * 1024
"""A request for a deployment on another machine must fit in this (413 otherwise)."""
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
_STRICT = ConfigDict(frozen=True, extra="forbid")


class Api(StrEnum):
    CHAT = "chat"
    DECISIONS = "decisions"


class QueueConfig(BaseModel):
    model_config = _STRICT

    request_deadline: Seconds = 600.0
    """First output must arrive within this, counted from arrival (waiting included)."""
    stream_idle_timeout: Seconds = 120.0
    """Longest quiet gap once output has started."""
    connect_timeout: Seconds = 10.0
    """Opening a connection to an engine may take this long; past it the engine never got the
    request, and the next instance is offered it."""
    max_running_per_deployment: int = Field(default=32, ge=1, le=4096)
    max_waiting_per_deployment: int = Field(default=64, ge=0, le=4096)
    max_waiting_total: int = Field(default=256, ge=0, le=65536)


class Limits(BaseModel):
    model_config = _STRICT

    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Chat request bodies above this are refused with 413."""
    max_decision_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    """Decision request bodies above this are refused with 413."""
    max_body_bytes_in_flight: int = Field(default=256 * 1024 * 1024, ge=1024)
    """Request bodies being read and held, over all requests at once; a body that would pass
    it is refused with 503 (retryable)."""
    body_read_timeout: Seconds = 120.0
    """A request body must have arrived whole within this (408 past it)."""
    header_timeout: Seconds = 10.0
    """A connection's request head must arrive within this; else it is closed."""
    max_connections: int = Field(default=2048, ge=1, le=1_000_000)
    """Client connections held at once; past it a connection gets a 503 and is closed."""
    max_answer_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """An engine answer the gateway assembles or reads whole (non-streamed chat, decisions)
    may be this large; past it, 502 engine_error."""


class Resources(BaseModel):
    model_config = _STRICT

    memory_budget: Bytes | None = None
    """What launched deployments may hold at once (ready and parked); absent: no limit."""


class Memory(BaseModel):
    model_config = _STRICT

    ready: Bytes
    parked: Bytes = 0


class Lifecycle(BaseModel):
    model_config = _STRICT

    activation: Literal["on_request", "explicit"] = "on_request"
    park: Literal["auto", "sleep", "stop"] = "auto"
    ready_idle_timeout: Seconds | None = None
    parked_idle_timeout: Seconds | None = None
    drain_timeout: Seconds = 30.0


class Launch(BaseModel):
    model_config = _STRICT

    command: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    """Added to the gateway's environment."""
    startup_timeout: Seconds = 600.0


class Instance(BaseModel):
    model_config = _STRICT

    url: str | None = None
    """An engine someone else runs (never launched, parked or stopped by the gateway)."""
    launch: Launch | None = None
    """An engine the gateway runs."""
    api_key_env: str | None = None
    """The engine's key is read from this environment variable (on the instance's host)."""
    host: str | None = None
    """The host machine that runs it (``capyctl-gateway serve --role server``); ``url`` and
    ``launch`` are then read on that host."""

    @field_validator("host")
    @classmethod
    def _host_name(cls, v: str | None) -> str | None:
        if v is not None and not HOST_NAME.fullmatch(v):
            raise ValueError(
                f"{v!r} is not a host name: 1 to 63 of a-z, 0-9 and '-', not at either end"
            )
        return v

    @model_validator(mode="after")
    def _one_kind(self) -> Self:
        if (self.url is None) == (self.launch is None):
            raise ValueError("an instance has either url (an engine someone runs) or launch")
        return self

    @field_validator("url")
    @classmethod
    def _origin(cls, v: str | None) -> str | None:
        if v is None:
            return None
        try:
            found = origin(v, what="url")
        except CanopyxError as exc:
            raise ValueError(str(exc)) from None
        if found != v.rstrip("/").lower():
            shown = re.sub(r"//[^/?#]*@", "//***@", v)  # credentials stay out of messages
            raise ValueError(f"{shown!r} is not an engine origin such as http://127.0.0.1:8000")
        return found


class Deployment(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, max_length=256)
    """The public model id clients send."""
    api: Api = Api.CHAT
    engine: EngineKind
    engine_version: str = Field(min_length=1)
    """As the engine reports it (llama.cpp: its build, e.g. b10798)."""
    served_model: str | None = None
    """The engine's own model id (default: name)."""
    version_mismatch: Literal["warn", "refuse"] = "warn"
    """An engine reporting another version than engine_version: logged (warn), or its
    instance is not routed to (refuse)."""
    instances: list[Instance] = Field(min_length=1)
    memory: Memory | None = None
    """What one launched instance holds in each state (against resources.memory_budget)."""
    lifecycle: Lifecycle = Lifecycle()

    @model_validator(mode="after")
    def _launchable(self) -> Self:
        for i, inst in enumerate(self.instances):
            if inst.launch is not None:
                problem = launch_problem(self.engine, inst.launch.command, inst.launch.env)
                if problem is not None:
                    raise ValueError(f"instances.{i}.launch.command: {problem}")
        if self.lifecycle.park == "sleep" and not self.can_park:
            raise ValueError(
                f"lifecycle.park: {self.engine.value} cannot park here; use auto or stop"
                + (
                    " (llama.cpp parks in router mode, --models-dir)"
                    if self.engine.value == "llamacpp"
                    else ""
                )
            )
        return self

    @cached_property
    def router(self) -> bool:
        """A llama.cpp server in router mode (``--models-dir``), serving many models."""
        return self.engine.value == "llamacpp" and any(
            i.launch is not None and "--models-dir" in i.launch.command for i in self.instances
        )

    @property
    def can_park(self) -> bool:
        return FACTS[self.engine].can_sleep or self.router

    @cached_property
    def parks(self) -> bool:
        """A park keeps the process up: asked (sleep), or where it always works (auto on a
        llama.cpp router; vLLM's sleep needs a GPU, so auto never asks it)."""
        park = self.lifecycle.park
        return park == "sleep" or (park == "auto" and self.router)

    @cached_property
    def launched(self) -> bool:
        return any(i.launch is not None for i in self.instances)

    @cached_property
    def remote(self) -> bool:
        """Its instances run on host machines (the server role)."""
        return any(i.host is not None for i in self.instances)

    @field_validator("engine")
    @classmethod
    def _served(cls, v: EngineKind) -> EngineKind:
        if v not in FACTS:
            kinds = ", ".join(k.value for k in FACTS)
            raise ValueError(f"the gateway serves {kinds}; {v.value} has a health-only adapter")
        return v

    @cached_property
    def engine_model(self) -> str:
        return self.served_model or self.name


class GatewayConfig(BaseModel):
    model_config = _STRICT

    queue: QueueConfig = QueueConfig()
    limits: Limits = Limits()
    engine_client: Literal["lean"] = "lean"
    """The engine requests' HTTP client: the gateway's own (the aiohttp fallback is gone)."""
    resources: Resources = Resources()
    deployments: list[Deployment] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> Self:
        seen: set[str] = set()
        for d in self.deployments:
            if d.name in seen:
                raise ValueError(f"two deployments are named {d.name!r}")
            seen.add(d.name)
            if self.resources.memory_budget is not None and d.launched and d.memory is None:
                raise ValueError(
                    f"deployment {d.name!r}: memory is required when resources.memory_budget "
                    "is set (what one instance holds ready and parked)"
                )
        return self

    def deployment(self, name: str) -> Deployment | None:
        return self._by_name.get(name)

    @cached_property
    def _by_name(self) -> dict[str, Deployment]:
        return {d.name: d for d in self.deployments}

    @property
    def hosts(self) -> set[str]:
        """The host machines the deployments name (none for a single machine)."""
        return {i.host for d in self.deployments for i in d.instances if i.host is not None}

    def role_problem(self, server: bool) -> str | None:
        """Why this configuration does not fit the role (server: every instance names its
        host; single machine: none does), or None."""
        for d in self.deployments:
            for n, inst in enumerate(d.instances):
                if server and inst.host is None:
                    return (
                        f"deployment {d.name!r}, instance {n}: name its host "
                        "(--role server runs no engine itself)"
                    )
                if not server and inst.host is not None:
                    return (
                        f"deployment {d.name!r}, instance {n} names host {inst.host!r}: "
                        "serve it with --role server"
                    )
        return None


def load_config(path: Path) -> GatewayConfig:
    """Read and validate ``path``. Raises ConfigError naming the offending key."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping with a 'deployments' list")
    try:
        return GatewayConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {_describe(e)}"
            for e in exc.errors()
        )
        raise ConfigError(f"{path}: {problems}") from None


def _describe(e: Any) -> str:
    if e["type"] == "extra_forbidden":
        return "unknown key"
    if e["type"] == "missing":
        return "required key missing"
    return str(e["msg"]).removeprefix("Value error, ")
