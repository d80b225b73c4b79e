"""The configuration of engines run as Kubernetes pods: the cluster (``kubernetes:``) and each
instance's pod template (``pod:``, beside its ``launch:``, which keeps the engine's command,
environment and start timeout as on one machine).

Values that Kubernetes itself defines (quantities, names, volumes) are checked here only as far
as a typo would otherwise reach the cluster: the API server checks the rest when the pod is
created, and its refusal fails the start with its own words.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from .parts import STRICT, Seconds

__all__ = ["KUBERNETES_POOL", "Kubernetes", "Pod", "PodResources", "Toleration"]

KUBERNETES_POOL = "kubernetes"
"""The memory pool of every pod this gateway runs (never this machine's, never a host's)."""

_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
"""A DNS-1123 label: a namespace's or a service account's name."""
_SUBDOMAIN = re.compile(r"[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?")
_KEY = re.compile(r"[-._a-zA-Z0-9]{1,253}")
_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_QUANTITY = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+|[KMGTPE]i|[numkMGTPE])?")
_RESOURCE = re.compile(
    r"(?:[a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)


def _quantities(v: dict[str, str | int]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, q in v.items():
        text = str(q) if isinstance(q, int) and not isinstance(q, bool) else q
        if not isinstance(text, str) or not _QUANTITY.fullmatch(text):
            raise ValueError(f"{name}: {q!r} is not a Kubernetes quantity such as 1, 500m or 24Gi")
        if not _RESOURCE.fullmatch(name):
            raise ValueError(f"{name!r} is not a resource name such as memory or nvidia.com/gpu")
        out[name] = text
    return out


class PodResources(BaseModel):
    """The container's requests and limits as Kubernetes takes them (``nvidia.com/gpu: 1``
    goes in limits; requests default to the limits, as Kubernetes does)."""

    model_config = STRICT

    requests: dict[str, str] = Field(default_factory=dict)
    limits: dict[str, str] = Field(default_factory=dict)

    @field_validator("requests", "limits", mode="before")
    @classmethod
    def _valid(cls, v: Any) -> Any:
        return _quantities(v) if isinstance(v, dict) else v


class Toleration(BaseModel):
    model_config = STRICT

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, ge=0)

    def manifest(self) -> dict[str, Any]:
        named = (("key", self.key), ("value", self.value), ("effect", self.effect))
        out: dict[str, Any] = {"operator": self.operator} | {k: v for k, v in named if v}
        if self.toleration_seconds is not None:
            out["tolerationSeconds"] = self.toleration_seconds
        return out


class Pod(BaseModel):
    """Where and how an instance's engine runs as a pod: its command and environment are its
    ``launch:``'s, with the flags the gateway forces (``--host 0.0.0.0 --port <port>``)."""

    model_config = STRICT

    image: str = Field(min_length=1)
    port: int = Field(default=8080, ge=1, le=65535)
    """The container port the engine listens on."""
    namespace: str | None = None
    """Default: ``kubernetes.namespace``."""
    resources: PodResources = PodResources()
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    service_account: str | None = None
    image_pull_secrets: list[str] = Field(default_factory=list)
    """Names of the Secrets that hold the registry's credentials (names only: the
    credentials stay in the cluster)."""
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    """Kubernetes volumes, as a pod spec writes them (where the model files are)."""
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list)
    secret_env: dict[str, str] = Field(default_factory=dict)
    """Environment variables read from Secrets, as ``VAR: secret-name/key`` (the engine's own
    key, a hub token): a pod's spec carries no secret itself, so a command or ``env`` that
    would is refused."""
    grace_period: int = Field(default=30, ge=1, le=3600)
    """Seconds a stopping engine gets between SIGTERM and SIGKILL (the pod's
    terminationGracePeriodSeconds). At least 1: a delete with 0 removes the pod from the API
    before its engine has stopped, which would prove a stop that has not happened."""

    @field_validator("namespace", "service_account")
    @classmethod
    def _label(cls, v: str | None) -> str | None:
        if v is not None and not _LABEL.fullmatch(v):
            raise ValueError(f"{v!r} is not a Kubernetes name: 1 to 63 of a-z, 0-9 and '-'")
        return v

    @field_validator("secret_env")
    @classmethod
    def _secret_refs(cls, v: dict[str, str]) -> dict[str, str]:
        for var, ref in v.items():
            secret, _, key = ref.partition("/")
            if not (_ENV.fullmatch(var) and _SUBDOMAIN.fullmatch(secret) and _KEY.fullmatch(key)):
                raise ValueError(f"{var}: write a Secret's key as secret-name/key, not {ref!r}")
        return v


class Kubernetes(BaseModel):
    """The cluster the gateway runs pods on."""

    model_config = STRICT

    namespace: str = "default"
    """Where pods go unless their ``pod.namespace`` says otherwise."""
    kubeconfig: Path | None = None
    """Default: ``KUBECONFIG``, else ``~/.kube/config``; inside a cluster with neither, the
    pod's own service account."""
    context: str | None = None
    """A kubeconfig context (default: its current one)."""
    owner: str = "capyctl-gateway"
    """The value of the ``capyctl.dev/owner`` label on this gateway's pods: the pods it adopts
    when it starts, and deletes when no deployment names them. Two gateways sharing a
    namespace need two owners."""
    watch_timeout: Seconds = Field(default=300.0, le=3600)
    """How long one watch request lasts before the gateway renews it (the API server ends it
    then, as client-go's reflectors ask)."""

    @field_validator("namespace", "owner")
    @classmethod
    def _label(cls, v: str) -> str:
        if not _LABEL.fullmatch(v):
            raise ValueError(f"{v!r} is not a Kubernetes name: 1 to 63 of a-z, 0-9 and '-'")
        return v
