"""What every engine adapter has in common.

An adapter knows one engine's endpoints and how to read them. It does no I/O of its own: the
collector hands it a `Fetcher`, and everything that interprets an answer is a pure function of
that answer, testable on recorded text.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import urlsplit

from .._errors import ConfigError, InfoParseError, UnexpectedStatusError
from .._scrape import Fetcher, RawResponse
from .._snapshot import Capacity, EngineKind, EngineMetrics, SupportLevel

__all__ = ["Discovery", "EngineAdapter", "Poll", "origin"]


@dataclass(frozen=True, slots=True)
class Discovery:
    """What an adapter learns once per connection."""

    capacity: Capacity | None = None
    engine_version: str | None = None
    process_start: float | None = None


@dataclass(frozen=True, slots=True)
class Poll:
    """What one collection cycle found."""

    metrics: EngineMetrics
    process_start: float | None = None


_HOST_NAME = re.compile(r"[a-z0-9._-]+")
_USERINFO = re.compile(r"//[^/?#]*@")


def origin(base_url: str, *, what: str = "base_url") -> str:
    """``scheme://host[:port]`` of an http(s) URL; any path, query, fragment or credentials are
    dropped. The one check of an engine URL in the SDK (and in the gateway).

    Args:
        base_url: the URL, e.g. ``http://127.0.0.1:8000/v1``.
        what: the option's name, for the error message.

    Raises:
        ConfigError: not http(s), no host, a host that is not a name or an IP address, or a port
            that is not a number from 1 to 65535.
    """
    shown = _USERINFO.sub("//***@", base_url)  # credentials in a URL stay out of messages
    problem = ConfigError(
        f"{what} must be an http(s) URL such as http://127.0.0.1:8000, got {shown!r}", option=what
    )
    try:
        parts = urlsplit(base_url.strip())
        port = parts.port  # raises on a port that is not a number in range
    except ValueError:  # also a bracketed host that is not an IPv6 address
        raise problem from None
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host or port == 0:
        raise problem
    # A backslash or a space would let this parser and the engine's disagree on the host.
    if any(c == "\\" or c.isspace() for c in parts.netloc):
        raise problem
    if ":" in host:
        host = f"[{host}]"  # urlsplit has checked that it is an IPv6 address
    elif not _HOST_NAME.fullmatch(host):
        raise problem
    return f"{parts.scheme}://{host}" + ("" if port is None else f":{port}")


class EngineAdapter(ABC):
    """Reads one engine's health, models, capacity and load."""

    kind: ClassVar[EngineKind]
    support: ClassVar[SupportLevel]
    health_path: ClassVar[str] = "/health"
    models_path: ClassVar[str] = "/v1/models"
    default_metrics_path: ClassVar[str] = "/metrics"

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        labels: Mapping[str, str] | None = None,
        metrics_url: str | None = None,
    ) -> None:
        self.base_url = origin(base_url)
        self.labels: dict[str, str] = dict(labels or {})
        if metrics_url is not None:
            origin(metrics_url, what="metrics_url")  # a full URL, but its origin must be sound
        self.metrics_url = metrics_url or self.base_url + self.default_metrics_path
        self._headers: dict[str, str] = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    @property
    def headers(self) -> Mapping[str, str]:
        """Headers sent on every collection request (the bearer credential, if any)."""
        return self._headers

    def url(self, path: str) -> str:
        return self.base_url + path

    async def get(self, fetch: Fetcher, url: str) -> RawResponse:
        return await fetch.get(url, headers=self._headers)

    # -- health -----------------------------------------------------------------------------
    async def check_health(self, fetch: Fetcher) -> RawResponse:
        """Raises when the engine is not healthy; returns the health answer."""
        resp = await self.get(fetch, self.url(self.health_path))
        self.parse_health(resp)
        return resp

    def parse_health(self, resp: RawResponse) -> None:
        expect_status(resp, 200, what="health")

    # -- models -----------------------------------------------------------------------------
    async def list_models(self, fetch: Fetcher) -> tuple[str, ...]:
        return parse_model_ids(await self.get(fetch, self.url(self.models_path)))

    # -- discovery and collection ------------------------------------------------------------
    async def discover(self, fetch: Fetcher, model_id: str) -> Discovery:
        """Capacity and version, read on each connection. Default: nothing to discover."""
        return Discovery()

    @abstractmethod
    async def collect(
        self, fetch: Fetcher, model_id: str, discovery: Discovery, health: RawResponse
    ) -> Poll:
        """The engine's load, after ``health`` (its health answer) passed.

        Raises a CanopyxError on any failure.
        """

    def __repr__(self) -> str:
        extra = f" labels={self.labels}" if self.labels else ""
        return f"<{type(self).__name__} {self.base_url}{extra}>"


class ModelLabelledAdapter(EngineAdapter):
    """An engine whose ``/metrics`` samples carry a ``model_name`` label (vLLM, SGLang)."""

    async def collect(
        self, fetch: Fetcher, model_id: str, discovery: Discovery, health: RawResponse
    ) -> Poll:
        resp = await self.get(fetch, self.metrics_url)
        expect_status(resp, 200, what="metrics")
        return self.parse_metrics(resp.text(), model_id, url=resp.url)

    @abstractmethod
    def parse_metrics(self, text: str, model_id: str, *, url: str | None = None) -> Poll:
        """The load figures of ``model_id`` (narrowed by ``labels``) in an exposition."""


class HealthOnlyAdapter(EngineAdapter):
    """An engine that publishes no load: fresh snapshots that say so."""

    support = SupportLevel.LIMITED

    async def collect(
        self, fetch: Fetcher, model_id: str, discovery: Discovery, health: RawResponse
    ) -> Poll:
        return Poll(EngineMetrics(has_engine_load=False))


def expect_status(resp: RawResponse, *expected: int, what: str) -> None:
    if resp.status not in expected:
        snippet = resp.text()[:200].strip()
        raise UnexpectedStatusError(
            f"{what}: {resp.url} answered {resp.status}" + (f": {snippet}" if snippet else ""),
            url=resp.url,
            status=resp.status,
        )


def json_object(resp: RawResponse, *, what: str) -> Mapping[str, object]:
    doc = resp.json()
    if not isinstance(doc, dict):
        raise InfoParseError(f"{what}: {resp.url} did not answer a JSON object", url=resp.url)
    return doc


def parse_model_ids(resp: RawResponse) -> tuple[str, ...]:
    """The ``data[].id`` of an OpenAI-style model list."""
    expect_status(resp, 200, what="models")
    doc = json_object(resp, what="models")
    data = doc.get("data")
    if not isinstance(data, list):
        raise InfoParseError(f"models: {resp.url} has no data list", url=resp.url)
    ids = [m.get("id") for m in data if isinstance(m, dict)]
    if not all(isinstance(i, str) for i in ids):
        raise InfoParseError(f"models: {resp.url} lists a model without a string id", url=resp.url)
    return tuple(str(i) for i in ids)


def int_or_none(value: object) -> int | None:
    """An integer from JSON or a label string; None for null, "None" and non-numbers."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None
