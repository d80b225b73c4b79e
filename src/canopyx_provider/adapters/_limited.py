"""Health-only engines: Ollama, mlx_lm.server and TabbyAPI publish no engine load, so their
snapshots are fresh but carry none; a strategy prices them from Canopy's own counts."""

from __future__ import annotations

from .._errors import InfoParseError, UnexpectedStatusError
from .._scrape import Fetcher, RawResponse
from .._snapshot import EngineKind
from ._base import Discovery, HealthOnlyAdapter, expect_status, json_object

__all__ = ["MlxAdapter", "OllamaAdapter", "TabbyApiAdapter"]


class OllamaAdapter(HealthOnlyAdapter):
    """Ollama (target 0.33.1): health and version from ``/api/version``."""

    kind = EngineKind.OLLAMA
    health_path = "/api/version"

    def parse_health(self, resp: RawResponse) -> None:
        expect_status(resp, 200, what="health")
        _version(resp)

    async def discover(self, fetch: Fetcher, model_id: str) -> Discovery:
        return Discovery(engine_version=_version(await self.check_health(fetch)))


class MlxAdapter(HealthOnlyAdapter):
    """``mlx_lm.server``: ``/health`` answers ``{"status": "ok"}``, 503 when unhealthy."""

    kind = EngineKind.MLX

    def parse_health(self, resp: RawResponse) -> None:
        _status_field(resp, healthy="ok")


class TabbyApiAdapter(HealthOnlyAdapter):
    """TabbyAPI: ``/health`` answers ``{"status": "healthy", "issues": []}``, 503 when not."""

    kind = EngineKind.TABBYAPI

    def parse_health(self, resp: RawResponse) -> None:
        _status_field(resp, healthy="healthy")


def _status_field(resp: RawResponse, *, healthy: str) -> None:
    expect_status(resp, 200, what="health")
    status = json_object(resp, what="health").get("status")
    if status != healthy:
        raise UnexpectedStatusError(
            f"health: {resp.url} reports status {status!r}", url=resp.url, status=resp.status
        )


def _version(resp: RawResponse) -> str:
    version = json_object(resp, what="version").get("version")
    if not isinstance(version, str):
        raise InfoParseError(f"version: {resp.url} has no string version", url=resp.url)
    return version
