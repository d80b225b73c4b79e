"""The gateway's YAML configuration, validated on load; unknown keys are refused."""

from __future__ import annotations

import itertools
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from canopyx_provider import EngineKind

from .._engines import DEVICES, FACTS, gpu_present, launch_problem
from .._log import secrets_in
from .bounds import Limits, QueueConfig
from .instance import HOST_NAME, Instance
from .parts import (
    STRICT,
    ConfigError,
    Launch,
    Lifecycle,
    Memory,
    Resources,
    Routing,
    Seconds,
)
from .pods import KUBERNETES_POOL, Kubernetes, Pod
from .rules import (
    budget_problem,
    empty_sections_dropped,
    kept_ready_problem,
    url_only_problem,
    warm_problem,
    warms,
)

__all__ = [
    "Api",
    "HOST_NAME",
    "MAX_WORKERS",
    "REMOTE_MAX_BODY_BYTES",
    "ConfigError",
    "Deployment",
    "GatewayConfig",
    "Instance",
    "KUBERNETES_POOL",
    "Kubernetes",
    "Launch",
    "Pod",
    "QueueConfig",
    "Seconds",
    "load_config",
]

REMOTE_MAX_BODY_BYTES = 8 * 1024 * 1024
"""A request for a deployment on another machine must fit in this (413 otherwise)."""


class Api(StrEnum):
    CHAT = "chat"
    DECISIONS = "decisions"


class Deployment(BaseModel):
    model_config = STRICT

    name: str = Field(min_length=1, max_length=256)
    """The public model id clients send (any characters but control characters; not ``.`` or
    ``..``, which no URL can name)."""
    api: Api = Api.CHAT
    engine: EngineKind
    engine_version: str = Field(min_length=1)
    """As the engine reports it (llama.cpp: its build, e.g. b10798)."""
    served_model: str | None = None
    """The engine's own model id (default: name)."""
    version_mismatch: Literal["warn", "refuse"] = "warn"
    """An engine reporting another version than engine_version: logged (warn), or its
    instance is not routed to (refuse)."""
    cached_tokens: Literal["shown", "withheld"] = "shown"
    """Whether clients are told how many of their prompt's tokens the engine found cached:
    without a ``cache_salt`` that count tells one client whether another's prompt is cached,
    so a deployment shared by clients who must not learn that withholds it."""
    reasoning: bool = False
    """Its engine separates the model's reasoning from its answer (vLLM's
    ``--reasoning-parser``, llama.cpp's ``--reasoning-format``): the Messages API's
    ``thinking`` is served, and refused otherwise."""
    instances: list[Instance] = Field(min_length=1)
    memory: Memory | None = None
    """What one launched instance holds in each state (against resources.memory_budget)."""
    lifecycle: Lifecycle = Lifecycle()
    routing: Routing = Routing()
    """How a request picks one of several instances (``prefix`` or ``least_load``)."""
    _gpu: bool = PrivateAttr(default=False)

    @model_validator(mode="after")
    def _launchable(self, info: ValidationInfo) -> Self:
        self._gpu = gpu_present((info.context or {}).get("devices", DEVICES))
        for i, inst in enumerate(self.instances):
            if inst.launch is not None:
                problem = launch_problem(self.engine, inst.launch.command, inst.launch.env)
                problem = problem or warm_problem(self, inst.launch.command)
                if problem is not None:
                    raise ValueError(f"instances.{i}.launch.command: {problem}")
                if inst.pod is not None and secrets_in(inst.launch.command, inst.launch.env):
                    raise ValueError(
                        f"instances.{i}.launch: a pod's spec is no place for a secret (anyone "
                        "who can read pods reads it); give it with pod.secret_env"
                    )
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

    @cached_property
    def schedules_by_priority(self) -> bool:
        """Its engines order their queue by ``priority`` (sent to them alone: `_by_priority`)."""
        return any(i.launch is not None and _by_priority(i.launch.command) for i in self.instances)

    @property
    def can_park(self) -> bool:
        return FACTS[self.engine].can_sleep or self.router

    @cached_property
    def parks(self) -> bool:
        """A park keeps the process up: asked (sleep), or under auto where it works (a
        llama.cpp router; vLLM's sleep and SGLang's release where this machine has a GPU)."""
        park = self.lifecycle.park
        if self.on_pods:  # a parked pod keeps its GPU in the scheduler's books: auto stops
            return park == "sleep"
        return park == "sleep" or (park == "auto" and (self.router or self.can_park and self._gpu))

    @cached_property
    def warms(self) -> bool:
        """Its engines' caches are kept across their stops (`rules.warms`)."""
        return warms(self)

    @cached_property
    def on_pods(self) -> bool:
        """Its engines run as Kubernetes pods."""
        return any(i.pod is not None for i in self.instances)

    @cached_property
    def launched(self) -> bool:
        return any(i.launch is not None for i in self.instances)

    @cached_property
    def remote(self) -> bool:
        """Its instances run on host machines (the server role)."""
        return any(i.host is not None for i in self.instances)

    @field_validator("name")
    @classmethod
    def _nameable(cls, v: str) -> str:
        if v in (".", ".."):
            raise ValueError(f"{v!r} cannot name a deployment: no URL path can name it")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in v):
            raise ValueError("a deployment's name has no control characters")
        return v

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


MAX_WORKERS = 64
"""The most worker processes one gateway runs."""


class GatewayConfig(BaseModel):
    model_config = STRICT

    queue: QueueConfig = QueueConfig()
    limits: Limits = Limits()
    engine_client: Literal["lean"] = "lean"
    """The engine requests' HTTP client: the gateway's own (the aiohttp fallback is gone)."""
    resources: Resources = Resources()
    workers: int = Field(default=1, ge=1, le=MAX_WORKERS)
    """Processes that serve the public listener (``serve --workers`` overrides it): with more
    than one, an authority process decides for all of them (``_workers/``)."""
    kubernetes: Kubernetes = Kubernetes()
    """The cluster that runs the instances configured with ``pod:``."""
    deployments: list[Deployment] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> Self:
        seen: set[str] = set()
        for d in self.deployments:
            if d.name in seen:
                raise ValueError(f"two deployments are named {d.name!r}")
            seen.add(d.name)
            if (problem := budget_problem(d, self.resources.memory_budget)) is not None:
                raise ValueError(problem)
        if (
            problem := kept_ready_problem(self.deployments, self.resources.memory_budget)
        ) is not None:
            raise ValueError(problem)
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
        config = GatewayConfig.model_validate(empty_sections_dropped(raw))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {_describe(e)}"
            for e in exc.errors()
        )
        raise ConfigError(f"{path}: {problems}") from None
    if (problem := url_only_problem(config.deployments)) is not None:
        raise ConfigError(f"{path}: {problem}")  # an operator's file, not a host's view
    return config


def _describe(e: Any) -> str:
    if e["type"] == "extra_forbidden":
        return "unknown key"
    if e["type"] == "missing":
        return "required key missing"
    return str(e["msg"]).removeprefix("Value error, ")


def _by_priority(command: list[str]) -> bool:
    """Whether an engine's command line asks it to schedule by a request's ``priority`` (vLLM's
    ``--scheduling-policy priority``, SGLang's ``--enable-priority-scheduling``); vLLM without
    it refuses a request that gives one."""
    if "--enable-priority-scheduling" in command or "--scheduling-policy=priority" in command:
        return True
    return ("--scheduling-policy", "priority") in itertools.pairwise(command)
