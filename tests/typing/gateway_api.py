"""Type-checked (by mypy), never run: capyctl_gateway's public API as an embedder writes it."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from capyctl_gateway import (
    GATEWAY_KEY,
    ConfigError,
    CredentialsError,
    Gateway,
    GatewayConfig,
    GatewayError,
    GatewayRunner,
    create_app,
    create_management_app,
    load_config,
    load_or_create_api_key,
)


async def embed(config_path: Path, state: Path) -> None:
    try:
        config: GatewayConfig = load_config(config_path)
        key: str = load_or_create_api_key(state)
    except (ConfigError, CredentialsError) as exc:
        raise SystemExit(str(exc)) from exc
    app: web.Application = create_app(config, key, env={"ENGINE_KEY": "secret"})
    runner = GatewayRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 8443).start()
    gateway: Gateway = app[GATEWAY_KEY]
    management = web.AppRunner(create_management_app(gateway))
    await management.setup()
    names: list[str] = list(gateway.fleet.routes)
    assert names
    await management.cleanup()
    await runner.cleanup()


def describe(err: GatewayError) -> tuple[int, str, str, bool]:
    return err.status, err.code, err.message, err.retryable
