"""The public application, and the runner that every gateway must be served by.

aiohttp notices a client that hangs up only when the runner cancels the handler
(``handler_cancellation=True``); without it a cut stream would run on at the engine. So the
setting is not the caller's to forget: `create_app` refuses to start under any runner but
`GatewayRunner`, which sets it (tests, benchmarks and the CLI alike).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

from aiohttp import web

from canopyx_provider import ProviderOptions

from .._config import GatewayConfig
from .._deployments.build import check_engine_keys
from .._fleet import open_fleet
from .._gateway import Gateway
from .._machines.enroll import ServerIdentity
from .._messages.errors import messages_error
from .._runners import KINDS, RunnerKind
from .calls import not_found, wrong_method
from .inference import Inference
from .messages import COUNT_TOKENS, MESSAGES
from .openapi import openapi_handler
from .server import HANGUPS_SEEN, LIMITS, GatewayRunner, Limits

__all__ = ["GATEWAY_KEY", "GatewayRunner", "create_app", "public_app"]

GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")


async def _require_gateway_runner(app: web.Application) -> None:
    if not app.get(HANGUPS_SEEN):
        raise RuntimeError(
            "serve capyctl-gateway's application with GatewayRunner: under another runner "
            "a client that hangs up would not stop its engine request"
        )


def create_app(
    config: GatewayConfig,
    api_key: str,
    *,
    env: Mapping[str, str] | None = None,
    collector_options: ProviderOptions | None = None,
    engine_logs: Path | None = None,
    state_dir: Path | None = None,
    server: ServerIdentity | None = None,
    runners: Mapping[str, RunnerKind] = KINDS,
) -> web.Application:
    """The inference application for ``config``; serve it with `GatewayRunner`. Its cleanup
    closes everything it opened. ``runners``: the registry of runner kinds (a test's own)."""
    env = os.environ if env is None else env
    check_engine_keys(config, env)  # a key that is not set is refused before anything opens
    gateway = Gateway(config, api_key)

    async def serve_fleet(_: web.Application) -> AsyncIterator[None]:
        async with open_fleet(
            config,
            env=env,
            telemetry=gateway.telemetry,
            collector_options=collector_options,
            clock=gateway.clock,
            engine_logs=engine_logs,
            state_dir=state_dir,
            server=server,
            runners=runners,
        ) as fleet:
            gateway.serve(fleet)
            yield

    app = public_app(gateway, Inference(gateway))
    app.cleanup_ctx.append(serve_fleet)
    return app


def public_app(gateway: Gateway, handlers: Inference) -> web.Application:
    """The public listener's application over ``gateway``: its routes, its bounds and the
    runner check; what it serves from is the caller's (`create_app`: this process's fleet; a
    worker: its authority)."""
    config = gateway.config
    app = web.Application(client_max_size=config.limits.max_body_bytes)
    app[GATEWAY_KEY] = gateway
    app[LIMITS] = Limits(
        max_connections=config.limits.max_connections,
        header_timeout=config.limits.header_timeout,
        keepalive_timeout=config.limits.keepalive_timeout,
    )
    app.on_startup.append(_require_gateway_runner)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_route("*", "/v1/models", wrong_method("GET"))
    # The name as the client wrote it, slashes included (openai's client escapes them as %2F).
    app.router.add_get("/v1/models/{model:[\\s\\S]+}", handlers.models)
    app.router.add_route("*", "/v1/models/{model:[\\s\\S]+}", wrong_method("GET"))
    app.router.add_post("/v1/chat/completions", handlers.chat)
    app.router.add_route("*", "/v1/chat/completions", wrong_method("POST"))
    app.router.add_post("/v1/responses", handlers.respond)
    app.router.add_route("*", "/v1/responses", wrong_method("POST"))
    app.router.add_route("*", "/v1/responses/{id:[\\s\\S]+}", handlers.stored)
    for surface in (MESSAGES, COUNT_TOKENS):  # Anthropic's, in its shape
        app.router.add_post(surface.endpoint, handlers.serves(surface))
        app.router.add_route("*", surface.endpoint, wrong_method("POST", messages_error))
    app.router.add_post("/v1/systemone", handlers.decide)
    app.router.add_route("*", "/v1/systemone", wrong_method("POST"))
    app.router.add_get("/openapi.json", openapi_handler(gateway))
    app.router.add_route("*", "/openapi.json", wrong_method("GET"))
    app.router.add_route("*", "/{tail:[\\s\\S]*}", not_found)
    return app
