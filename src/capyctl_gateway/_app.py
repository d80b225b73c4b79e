"""The gateway application: routes, authentication, request IDs, and the upstream session."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from aiohttp import web

from ._config import ConfigError, Deployment, GatewayConfig, Instance
from ._errors import GatewayError
from ._log import event
from ._relay import RelayContext, _gateway_error_response, relay_chat
from ._ulid import new_ulid
from ._validate import caller_request_id, parse_chat_request

__all__ = ["Gateway", "create_app"]

logger = logging.getLogger(__name__)
GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")
UNAUTHORIZED = GatewayError(401, "unauthorized", "missing or invalid api key")


@dataclass(eq=False)
class _Instance:
    index: int
    url: str
    host: str
    headers: dict[str, str]
    in_flight: int = 0


@dataclass(eq=False)
class _Route:
    deployment: Deployment
    instances: list[_Instance]
    turn: itertools.count[int] = field(default_factory=itertools.count)

    def choose(self) -> _Instance:
        """The instance with the fewest requests in flight; ties rotate."""
        start = next(self.turn) % len(self.instances)
        ordered = self.instances[start:] + self.instances[:start]
        return min(ordered, key=lambda i: i.in_flight)


def _engine_headers(instance: Instance, env: dict[str, str]) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if instance.api_key_env is not None:
        key = env.get(instance.api_key_env)
        if not key:
            raise ConfigError(
                f"instance {instance.url}: api_key_env {instance.api_key_env} is not set"
            )
        headers["Authorization"] = f"Bearer {key}"
    return headers


class Gateway:
    """Everything one gateway process holds; no module globals."""

    def __init__(
        self, config: GatewayConfig, api_key: str, *, env: dict[str, str] | None = None
    ) -> None:
        self.config = config
        self._key = api_key.encode()
        env = dict(os.environ) if env is None else env
        self.routes = {
            d.name: _Route(
                d,
                [
                    _Instance(
                        i, inst.url, urlsplit(inst.url).hostname or "", _engine_headers(inst, env)
                    )
                    for i, inst in enumerate(d.instances)
                ],
            )
            for d in config.deployments
        }
        self.session: aiohttp.ClientSession | None = None
        self._models = orjson.dumps(
            {
                "object": "list",
                "data": [
                    {"id": d.name, "object": "model", "capyctl": {"api": d.api.value}}
                    for d in config.deployments
                ],
            }
        )

    # -- lifecycle --------------------------------------------------------------------
    async def _session_ctx(self, app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        ) as session:
            self.session = session
            yield
            self.session = None

    # -- helpers ----------------------------------------------------------------------
    def authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(key.lstrip(" ").encode(), self._key)

    async def _read_body(self, request: web.Request, limit: int) -> bytes:
        too_large = GatewayError(
            413, "request_too_large", f"the request body is over {limit} bytes"
        )
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        parts: list[bytes] = []
        size = 0
        while True:
            block = await request.content.readany()
            if not block:
                break
            size += len(block)
            if size > limit:
                raise too_large
            parts.append(block)
        return b"".join(parts)

    # -- handlers ---------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return _gateway_error_response(UNAUTHORIZED, {})
        return web.Response(body=self._models, content_type="application/json")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        rid = new_ulid()
        headers = {"X-CapyCTL-Request-Id": rid}
        try:
            if not self.authorized(request):
                raise UNAUTHORIZED
            caller = caller_request_id(request.headers.getall("X-Request-Id", []))
            if caller is not None:
                headers["X-Request-Id"] = caller
            raw = await self._read_body(request, self.config.limits.max_body_bytes)
            chat = parse_chat_request(raw, self.config)
        except GatewayError as err:
            return _gateway_error_response(err, headers)
        route = self.routes[chat.deployment.name]
        instance = route.choose()
        _log_selection(rid, caller, chat.deployment, instance)
        body = chat.body
        body["model"] = chat.deployment.engine_model
        body["stream"] = True
        if not chat.stream:
            options = body.get("stream_options") or {}
            body["stream_options"] = {**options, "include_usage": True}
        assert self.session is not None
        ctx = RelayContext(
            session=self.session,
            url=instance.url + "/v1/chat/completions",
            engine_headers=instance.headers,
            deployment=chat.deployment,
            response_headers=headers,
            arrival=arrival,
            request_deadline=self.config.queue.request_deadline,
            stream_idle_timeout=self.config.queue.stream_idle_timeout,
        )
        instance.in_flight += 1
        try:
            return await relay_chat(request, ctx, body, stream=chat.stream)
        finally:
            instance.in_flight -= 1

    async def not_found(self, request: web.Request) -> web.Response:
        err = GatewayError(404, "not_found", f"no route {request.method} {request.path}")
        return _gateway_error_response(err, {})


def _log_selection(rid: str, caller: str | None, dep: Deployment, instance: _Instance) -> None:
    who = f" (caller {caller})" if caller is not None else ""
    fields: dict[str, Any] = {
        "capyctl_request_id": rid,
        "deployment": dep.name,
        "instance": instance.index,
        "host": instance.host,
    }
    if caller is not None:
        fields["caller_request_id"] = caller
    event(
        "router_selection",
        f"request {rid}{who} {dep.name} -> {instance.host} instance {instance.index}",
        **fields,
    )


def create_app(
    config: GatewayConfig, api_key: str, *, env: dict[str, str] | None = None
) -> web.Application:
    """The aiohttp application for ``config``; its cleanup closes everything it opened."""
    gateway = Gateway(config, api_key, env=env)
    app = web.Application(client_max_size=config.limits.max_body_bytes)
    app[GATEWAY_KEY] = gateway
    app.cleanup_ctx.append(gateway._session_ctx)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_post("/v1/chat/completions", gateway.chat)
    app.router.add_route("*", "/{tail:.*}", gateway.not_found)
    return app
