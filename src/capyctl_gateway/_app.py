"""The gateway application: routes, authentication, request IDs, admission, and the engines'
collector that settles cut requests."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from aiohttp import web
from yarl import URL

from canopyx_provider import (
    AiohttpFetcher,
    Collector,
    EngineAdapter,
    ProviderOptions,
    llama_cpp,
    sglang,
    tensorfold,
    vllm,
)

from ._config import Api, ConfigError, Deployment, EngineFamily, GatewayConfig, Instance
from ._decisions import parse_decision_request, relay_decision
from ._errors import GatewayError, NotAcceptedError
from ._log import event
from ._queue import Admission, DeploymentQueue
from ._relay import RelayContext, _gateway_error_response, relay_chat
from ._settle import InstanceLedger, Settlement
from ._ulid import new_ulid
from ._validate import caller_request_id, parse_chat_request

__all__ = ["Gateway", "create_app", "create_management_app"]

logger = logging.getLogger(__name__)
GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")
UNAUTHORIZED = GatewayError(401, "unauthorized", "missing or invalid api key")
MAX_OFFERS = 4
IDLE_CONNECTION_S = 4.0
"""How long an idle engine connection stays pooled: under the 5 s after which llama-server and
uvicorn (vLLM, SGLang) close one, so that the gateway never sends on a connection the engine
is closing at that moment (measured on llama-server b10798: idle 5.5 s, then the next request
met a closed connection)."""
"""Instances a request is offered to, when the ones before provably never got it."""
_FACTORIES: dict[EngineFamily, Callable[..., EngineAdapter]] = {
    EngineFamily.VLLM: vllm,
    EngineFamily.SGLANG: sglang,
    EngineFamily.LLAMACPP: llama_cpp,
    EngineFamily.TENSORFOLD: tensorfold,
}


@dataclass(eq=False)
class _Instance:
    index: int
    url: str
    host: str
    headers: dict[str, str]
    engine_key: str | None
    ledger: InstanceLedger
    chat_url: URL = field(init=False)
    decision_url: URL = field(init=False)

    def __post_init__(self) -> None:
        # Parsed once: aiohttp would parse a string URL on every request.
        self.chat_url = URL(self.url + "/v1/chat/completions")
        self.decision_url = URL(self.url + "/v1/systemone")


@dataclass(eq=False)
class _Route:
    deployment: Deployment
    instances: list[_Instance]
    queue: DeploymentQueue
    turn: itertools.count[int] = field(default_factory=itertools.count)

    def choose(self, exclude: set[int] | frozenset[int] = frozenset()) -> _Instance | None:
        """The instance charged with the fewest requests (running and cut), among those not
        excluded; ties rotate."""
        if len(self.instances) == 1:
            only = self.instances[0]
            return None if only.index in exclude else only
        start = next(self.turn) % len(self.instances)
        ordered = [
            i for i in self.instances[start:] + self.instances[:start] if i.index not in exclude
        ]
        return min(ordered, key=lambda i: i.ledger.charged) if ordered else None


def _engine_key(instance: Instance, env: dict[str, str]) -> str | None:
    if instance.api_key_env is None:
        return None
    key = env.get(instance.api_key_env)
    if not key:
        raise ConfigError(f"instance {instance.url}: api_key_env {instance.api_key_env} is not set")
    return key


class Gateway:
    """Everything one gateway process holds; no module globals."""

    def __init__(
        self,
        config: GatewayConfig,
        api_key: str,
        *,
        env: dict[str, str] | None = None,
        collector_options: ProviderOptions | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._key = api_key.encode()
        env = dict(os.environ) if env is None else env
        self.settlement = Settlement(clock)
        self.collector_options = collector_options or ProviderOptions()
        self._clock = clock
        admission = Admission(config.queue.max_waiting_total)
        self.routes: dict[str, _Route] = {}
        for d in config.deployments:
            instances = []
            for i, inst in enumerate(d.instances):
                key = _engine_key(inst, env)
                headers = {
                    "Content-Type": "application/json",
                    "Accept": "text/event-stream",
                    # The stream is parsed as it comes: the engine must not compress it.
                    "Accept-Encoding": "identity",
                    # Ours, so that aiohttp adds none of its own (and skips work doing so).
                    "User-Agent": "capyctl-gateway",
                }
                if key is not None:
                    headers["Authorization"] = f"Bearer {key}"
                if d.engine is EngineFamily.LLAMACPP:
                    # llama-server closes its connection after every streamed answer without
                    # saying so (measured on b10798: the next request sent on it met a closed
                    # socket). Asked to close, it says so, and the connection is not reused.
                    headers["Connection"] = "close"
                ledger = self.settlement.ledger(f"{d.name}/{i}")
                host = urlsplit(inst.url).hostname or ""
                instances.append(_Instance(i, inst.url, host, headers, key, ledger))
            queue = DeploymentQueue(
                admission,
                max_running=config.queue.max_running_per_deployment,
                max_waiting=config.queue.max_waiting_per_deployment,
            )
            self.routes[d.name] = _Route(d, instances, queue)
        self.session: aiohttp.ClientSession | None = None
        self._drains: set[asyncio.Task[None]] = set()
        """Engine connections waiting for the end of a finished answer's body (see _relay)."""
        self.collector: Collector | None = None
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
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=IDLE_CONNECTION_S
        )
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),  # engines set no cookies; skip the jar per request
        ) as session:
            self.session = session
            try:
                yield
            finally:
                self.session = None
                for task in list(self._drains):
                    task.cancel()  # each closes its connection
                await asyncio.gather(*self._drains, return_exceptions=True)

    async def _collector_ctx(self, app: web.Application) -> AsyncIterator[None]:
        """The engines' collector: polls each instance, and settles cut requests.

        It fetches through its own aiohttp session (aiohttp costs less CPU per GET than the
        SDK's default httpx client): at most 4 kept-alive connections per engine, no cookie
        jar, each GET bounded by the collector's request timeout. The session closes after the
        collector.
        """
        timeout_s = self.collector_options.request_timeout_s
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, limit_per_host=4, keepalive_timeout=IDLE_CONNECTION_S
            ),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            cookie_jar=aiohttp.DummyCookieJar(),
        ) as session:
            collector = Collector(
                options=self.collector_options,
                fetcher=AiohttpFetcher(session, timeout_s=timeout_s, clock=self._clock),
                clock=self._clock,
                hooks=[self.settlement],
            )
            async with collector:
                for route in self.routes.values():
                    d = route.deployment
                    for inst in route.instances:
                        adapter = _FACTORIES[d.engine](inst.url, api_key=inst.engine_key)
                        collector.add(inst.ledger.key, adapter, model_id=d.engine_model)
                self.collector = self.settlement.collector = collector
                try:
                    yield
                finally:
                    self.collector = self.settlement.collector = None

    # -- helpers ----------------------------------------------------------------------
    def authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        # aiohttp decodes header bytes that are not UTF-8 as surrogates: keep them comparable.
        return hmac.compare_digest(key.lstrip(" ").encode("utf-8", "surrogateescape"), self._key)

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
        return await self._serve(request, api=Api.CHAT)

    async def decide(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, api=Api.DECISIONS)

    async def _serve(self, request: web.Request, *, api: Api) -> web.StreamResponse:
        """What chat and decision requests share: the key, IDs, checks, queue, accounting."""
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        rid = new_ulid()
        headers = {"X-CapyCTL-Request-Id": rid}
        limits = self.config.limits
        try:
            if not self.authorized(request):
                raise UNAUTHORIZED
            caller = caller_request_id(request.headers.getall("X-Request-Id", []))
            if caller is not None:
                headers["X-Request-Id"] = caller
            if api is Api.CHAT:
                raw = await self._read_body(request, limits.max_body_bytes)
                chat = parse_chat_request(raw, self.config)
                deployment, body, stream = chat.deployment, chat.body, chat.stream
            else:
                raw = await self._read_body(request, limits.max_decision_body_bytes)
                decision = parse_decision_request(raw, self.config)
                deployment, body, stream = decision.deployment, decision.body, False
            route = self.routes[deployment.name]
            await route.queue.acquire(arrival + self.config.queue.request_deadline)
        except GatewayError as err:
            return _gateway_error_response(err, headers)
        try:
            body["model"] = deployment.engine_model
            if api is Api.CHAT:
                body["stream"] = True
                if not stream:
                    options = body.get("stream_options") or {}
                    body["stream_options"] = {**options, "include_usage": True}
            refused: set[int] = set()
            last = "no instance to send it to"
            while len(refused) < MAX_OFFERS:
                instance = route.choose(exclude=refused)
                if instance is None:
                    break
                _log_selection(rid, caller, deployment, instance)
                try:
                    return await self._forward(
                        request,
                        api,
                        deployment,
                        instance,
                        body,
                        stream,
                        headers=headers,
                        arrival=arrival,
                        rid=rid,
                    )
                except NotAcceptedError as exc:
                    # The engine never saw it: another instance may serve it, within the deadline.
                    refused.add(instance.index)
                    last = str(exc)
                    _log_failover(rid, caller, deployment, instance, last)
            unreached = GatewayError(502, "engine_error", last)
            return _gateway_error_response(unreached, headers)
        finally:
            route.queue.release()

    async def _forward(
        self,
        request: web.Request,
        api: Api,
        deployment: Deployment,
        instance: _Instance,
        body: dict[str, Any],
        stream: bool,
        *,
        headers: dict[str, str],
        arrival: float,
        rid: str,
    ) -> web.StreamResponse:
        assert self.session is not None
        ctx = RelayContext(
            session=self.session,
            url=instance.chat_url if api is Api.CHAT else instance.decision_url,
            engine_headers=instance.headers,
            deployment=deployment,
            response_headers=headers,
            arrival=arrival,
            request_deadline=self.config.queue.request_deadline,
            stream_idle_timeout=self.config.queue.stream_idle_timeout,
            drains=self._drains,
        )
        instance.ledger.running += 1
        try:
            if api is Api.DECISIONS:
                return await relay_decision(ctx, body)
            return await relay_chat(request, ctx, body, stream=stream)
        finally:
            instance.ledger.running -= 1
            self._account(rid, instance, ctx)

    def _account(self, rid: str, instance: _Instance, ctx: RelayContext) -> None:
        """A request that may still run on the engine stays charged until it is settled."""
        out = ctx.outcome
        if out.sent and not out.completed:
            reason = out.cut or "engine stream broken"
            self.settlement.cut(instance.ledger, rid, answered=out.answered, reason=reason)

    async def not_found(self, request: web.Request) -> web.Response:
        err = GatewayError(404, "not_found", f"no route {request.method} {request.path}")
        return _gateway_error_response(err, {})

    async def wrong_method(self, request: web.Request) -> web.Response:
        err = GatewayError(
            405, "method_not_allowed", f"{request.path} answers POST, not {request.method}"
        )
        return _gateway_error_response(err, {"X-CapyCTL-Request-Id": new_ulid(), "Allow": "POST"})

    # -- management -------------------------------------------------------------------
    def deployment_status(self, name: str) -> dict[str, Any] | None:
        route = self.routes.get(name)
        if route is None:
            return None
        d = route.deployment
        now = self._clock()
        instances = []
        for inst in route.instances:
            row: dict[str, Any] = {
                "index": inst.index,
                "url": inst.url,
                "host": inst.host,
                "state": "unknown",
                "running": None,
                "waiting": None,
                "snapshot_age_s": None,
                "router_running": inst.ledger.running,
                "cancelled": [
                    {
                        "capyctl_request_id": c.request_id,
                        "reason": c.reason,
                        "age_s": round(now - c.cut_at, 3),
                        "settles": c.rule.value,
                    }
                    for c in inst.ledger.cut
                ],
            }
            if self.collector is not None:
                status = self.collector.status(inst.ledger.key)
                row["state"] = status.state.value
                snap = status.latest
                if snap is not None:
                    row["running"] = snap.metrics.running_requests
                    row["waiting"] = snap.metrics.waiting_requests
                    row["snapshot_age_s"] = round(snap.age_s(now), 3)
                if status.error:
                    row["error"] = status.error
            instances.append(row)
        ready = any(i["state"] == "ready" for i in instances)
        return {
            "deployment": {
                "name": d.name,
                "api": d.api.value,
                "engine": d.engine.value,
                "engine_version": d.engine_version,
                "served_model": d.engine_model,
                "state": "ready" if ready else "unavailable",
                "running": route.queue.running,
                "waiting": route.queue.waiting,
            },
            "instances": instances,
        }

    async def management_deployment(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return _gateway_error_response(UNAUTHORIZED, {})
        status = self.deployment_status(request.match_info["name"])
        if status is None:
            err = GatewayError(
                404, "unknown_model", f"no deployment named {request.match_info['name']!r}"
            )
            return _gateway_error_response(err, {})
        return web.Response(body=orjson.dumps(status), content_type="application/json")


def _request_fields(
    rid: str, caller: str | None, dep: Deployment, instance: _Instance
) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "capyctl_request_id": rid,
        "deployment": dep.name,
        "instance": instance.index,
        "host": instance.host,
    }
    if caller is not None:
        fields["caller_request_id"] = caller
    return fields


def _log_failover(
    rid: str, caller: str | None, dep: Deployment, instance: _Instance, detail: str
) -> None:
    event(
        "router_failover",
        "request %s%s %s: instance %d on %s did not take it (%s)",
        rid,
        f" (caller {caller})" if caller is not None else "",
        dep.name,
        instance.index,
        instance.host,
        detail,
        **_request_fields(rid, caller, dep, instance),
        reason="not_accepted",
        detail=detail,
    )


def _log_selection(rid: str, caller: str | None, dep: Deployment, instance: _Instance) -> None:
    event(
        "router_selection",
        "request %s%s %s -> %s instance %d",
        rid,
        f" (caller {caller})" if caller is not None else "",
        dep.name,
        instance.host,
        instance.index,
        **_request_fields(rid, caller, dep, instance),
    )


def create_app(
    config: GatewayConfig,
    api_key: str,
    *,
    env: dict[str, str] | None = None,
    collector_options: ProviderOptions | None = None,
) -> web.Application:
    """The inference application for ``config``; its cleanup closes everything it opened."""
    gateway = Gateway(config, api_key, env=env, collector_options=collector_options)
    app = web.Application(client_max_size=config.limits.max_body_bytes)
    app[GATEWAY_KEY] = gateway
    app.cleanup_ctx.append(gateway._session_ctx)
    app.cleanup_ctx.append(gateway._collector_ctx)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_post("/v1/chat/completions", gateway.chat)
    app.router.add_route("*", "/v1/chat/completions", gateway.wrong_method)
    app.router.add_post("/v1/systemone", gateway.decide)
    app.router.add_route("*", "/v1/systemone", gateway.wrong_method)
    app.router.add_route("*", "/{tail:.*}", gateway.not_found)
    return app


def create_management_app(gateway: Gateway) -> web.Application:
    """The management API (served on loopback only), protected by the same key."""
    app = web.Application()
    app.router.add_get("/management/v1/deployments/{name}", gateway.management_deployment)
    app.router.add_route("*", "/{tail:.*}", gateway.not_found)
    return app
