"""``capyctl-gateway``: serve the OpenAI chat API in front of the configured engines."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer
from aiohttp import web

from ._app import create_app
from ._config import ConfigError, load_config
from ._identity import CredentialsError, credentials_path, load_or_create_api_key
from ._log import configure_logging

app = typer.Typer(
    name="capyctl-gateway",
    help="An OpenAI-compatible gateway in front of vLLM, SGLang, llama.cpp and TensorFold.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

DEFAULT_LISTEN = "0.0.0.0:8443"
DEFAULT_STATE = Path("~/.local/state/capyctl")


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--listen takes HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104 - the documented default


@app.callback()
def _main() -> None:
    """capyctl-gateway."""


@app.command()
def serve(
    config: Annotated[Path, typer.Option("--config", help="The YAML configuration.")],
    listen: Annotated[
        str | None, typer.Option("--listen", help="HOST:PORT (env CAPYCTL_INFERENCE_ADDR).")
    ] = None,
    state_dir: Annotated[
        Path | None, typer.Option("--state-dir", help="State directory (env CAPYCTL_STATE_DIR).")
    ] = None,
    log_format: Annotated[
        str, typer.Option("--log-format", help="text or json (default: text on a terminal).")
    ] = "auto",
) -> None:
    """Serve until interrupted."""
    fmt = log_format if log_format != "auto" else ("text" if sys.stderr.isatty() else "json")
    if fmt not in ("text", "json"):
        raise _fail("--log-format takes text or json")
    configure_logging(fmt)
    state = (state_dir or Path(os.environ.get("CAPYCTL_STATE_DIR") or DEFAULT_STATE)).expanduser()
    try:
        host, port = _listen(listen or os.environ.get("CAPYCTL_INFERENCE_ADDR") or DEFAULT_LISTEN)
        cfg = load_config(config)
        key = load_or_create_api_key(state)
        application = create_app(cfg, key)
    except (ConfigError, CredentialsError) as exc:
        raise _fail(str(exc)) from None
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise _fail(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    typer.echo(
        f"capyctl-gateway listening on http://{host}:{sock.getsockname()[1]}/v1 "
        f"(key in {credentials_path(state)})",
        err=True,
    )
    web.run_app(
        application,
        sock=sock,
        print=None,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=5,
    )


def _fail(message: str) -> typer.Exit:
    typer.echo(f"capyctl-gateway: {message}", err=True)
    return typer.Exit(2)


def main() -> None:
    app()
