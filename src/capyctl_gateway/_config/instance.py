"""One configured instance of a deployment: where its engine is (``url:``) or how the gateway
runs it (``launch:``), on this machine, on a host, or as a Kubernetes pod (``pod:``)."""

from __future__ import annotations

import re
from typing import Self

from pydantic import BaseModel, field_validator, model_validator

from canopyx_provider import CanopyxError
from canopyx_provider.adapters import origin

from .parts import STRICT, Launch
from .pods import KUBERNETES_POOL, Pod

__all__ = ["HOST_NAME", "Instance"]

HOST_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")


class Instance(BaseModel):
    model_config = STRICT

    url: str | None = None
    """An engine someone else runs (never launched, parked or stopped by the gateway)."""
    launch: Launch | None = None
    """An engine the gateway runs."""
    api_key_env: str | None = None
    """The engine's key is read from this environment variable (on the instance's host)."""
    host: str | None = None
    """The host machine that runs it (``capyctl-gateway serve --role server``); ``url`` and
    ``launch`` are then read on that host."""
    pod: Pod | None = None
    """Its ``launch:`` runs as a Kubernetes pod (``kubernetes:`` says which cluster)."""

    @property
    def pool(self) -> str | None:
        """Where its memory counts (for the configuration's checks): its host's name, the
        pods' pool, or None for this machine."""
        return KUBERNETES_POOL if self.pod is not None else self.host

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
        if self.pod is not None and (self.launch is None or self.host is not None):
            raise ValueError("pod runs the instance's launch: command on Kubernetes, not on a host")
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
