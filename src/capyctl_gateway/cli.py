"""``capyctl-gateway``: serve the OpenAI chat API, and report on a running gateway."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console

from ._cli_common import (
    fail,
    management_address,
    path_segment,
    state_path,
    use_uvloop,
)
from ._cli_serve import prepare, run
from ._config import MAX_WORKERS
from ._errors import OperatorError
from ._identity import (
    load_or_create_server_key,
    read_api_key,
    server_credentials_path,
)
from ._log import configure_logging
from ._management.render import acted, print_list, print_status

app = typer.Typer(
    name="capyctl-gateway",
    help="An OpenAI-compatible gateway in front of vLLM, SGLang, llama.cpp and TensorFold. "
    "Installed as both capyctl and capyctl-gateway: one program under two names.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
status_app = typer.Typer(help="Report on the running gateway.", no_args_is_help=True)
app.add_typer(status_app, name="status")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"capyctl-gateway {_package_version()}")
        raise typer.Exit()


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("canopyx")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """An OpenAI-compatible gateway in front of vLLM, SGLang, llama.cpp and TensorFold."""


DEFAULT_LISTEN = "0.0.0.0:8443"
DEFAULT_CONTROL = "0.0.0.0:7445"

StateOpt = Annotated[
    Path | None, typer.Option("--state-dir", help="State directory (env CAPYCTL_STATE_DIR).")
]
ManagementOpt = Annotated[
    str | None,
    typer.Option("--management", help="Management HOST:PORT (env CAPYCTL_MANAGEMENT_ADDR)."),
]


@app.command()
def serve(
    config: Annotated[Path, typer.Option("--config", help="The YAML configuration.")],
    listen: Annotated[
        str | None, typer.Option("--listen", help="HOST:PORT (env CAPYCTL_INFERENCE_ADDR).")
    ] = None,
    state_dir: StateOpt = None,
    management: ManagementOpt = None,
    log_format: Annotated[
        str, typer.Option("--log-format", help="text or json (default: text on a terminal).")
    ] = "auto",
    metrics: Annotated[
        str | None,
        typer.Option(
            "--metrics",
            help="Also serve GET /metrics (same key) on HOST:PORT, e.g. for a Prometheus "
            "scraper on another machine (env CAPYCTL_METRICS_ADDR).",
        ),
    ] = None,
    role: Annotated[
        str,
        typer.Option("--role", help="single (engines here) or server (engines on hosts)."),
    ] = "single",
    control: Annotated[
        str, typer.Option("--control", help="The server's control listener, for its hosts.")
    ] = DEFAULT_CONTROL,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            min=1,
            max=MAX_WORKERS,
            help="Processes that serve the public listener (default: workers: in the "
            "configuration, else 1).",
        ),
    ] = None,
) -> None:
    """Serve until interrupted."""
    fmt = log_format if log_format != "auto" else ("text" if sys.stderr.isatty() else "json")
    if fmt not in ("text", "json"):
        raise fail("--log-format takes text or json")
    configure_logging(fmt)
    try:
        serving = prepare(
            config,
            listen=listen or os.environ.get("CAPYCTL_INFERENCE_ADDR") or DEFAULT_LISTEN,
            state=state_path(state_dir),
            management=management,
            metrics=metrics or os.environ.get("CAPYCTL_METRICS_ADDR"),
            role=role,
            control=control,
            workers=workers,
        )
    except OperatorError as exc:
        raise fail(str(exc)) from None
    use_uvloop()
    team = (serving.workers, fmt) if serving.workers > 1 else None
    asyncio.run(run(*serving.listeners, team))


def _where(state_dir: Path | None, management: str | None) -> tuple[str, int, str]:
    """The management listener's host and port, and the key it takes."""
    try:
        host, port = management_address(management)
        state = state_path(state_dir)
        try:
            key = read_api_key(state)
        except FileNotFoundError:  # a server's key, if this is a server's state
            if not server_credentials_path(state).exists():
                raise
            key = load_or_create_server_key(state)
    except FileNotFoundError as exc:
        raise fail(
            f"no credentials at {exc.filename}: is this the gateway's --state-dir?"
        ) from None
    except OperatorError as exc:
        raise fail(str(exc)) from None
    return host, port, key


def _call(method: str, path: str, state_dir: Path | None, management: str | None) -> Any:
    """One call to the running gateway's management API; its JSON answer."""
    host, port, key = _where(state_dir, management)
    url = f"http://{host}:{port}/management/v1/{path}"
    try:
        # A start waits for the engine: as long as its startup_timeout allows.
        resp = httpx.request(method, url, headers={"Authorization": f"Bearer {key}"}, timeout=3600)
    except httpx.TransportError as exc:
        raise fail(f"no gateway answers on {host}:{port}: {exc}") from None
    if resp.status_code != 200:
        try:
            message = resp.json().get("message", resp.text)
        except ValueError:
            message = resp.text
        raise fail(f"{resp.status_code}: {message}")
    return resp.json()


@app.command("console")
def console(state_dir: StateOpt = None, management: ManagementOpt = None) -> None:
    """Print the address that opens the console on this machine: it carries a one-time ticket
    (good for 60 s, once), never the key, so what the browser's history keeps opens nothing."""
    host, port, _ = _where(state_dir, management)
    ticket = _call("POST", "console/tickets", state_dir, management)["ticket"]
    typer.echo(f"http://{f'[{host}]' if ':' in host else host}:{port}/#ticket={ticket}")


@status_app.command("deployment")
def status_deployment(
    name: Annotated[str, typer.Argument(help="The deployment's name.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON document.")] = False,
    state_dir: StateOpt = None,
    management: ManagementOpt = None,
) -> None:
    """A deployment, its instances, and the cancelled requests each still counts."""
    doc = _call("GET", f"deployments/{path_segment(name)}", state_dir, management)
    if as_json:
        typer.echo(json.dumps(doc))
    else:
        print_status(Console(highlight=False), doc)


@app.command("list")
def list_deployments(
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON document.")] = False,
    state_dir: StateOpt = None,
    management: ManagementOpt = None,
) -> None:
    """Every deployment with its state, instances and memory."""
    doc = _call("GET", "deployments", state_dir, management)
    if as_json:
        typer.echo(json.dumps(doc))
    else:
        print_list(Console(highlight=False), doc)


def _act(action: str, name: str, state_dir: Path | None, management: str | None) -> None:
    doc = _call("POST", f"deployments/{path_segment(name)}/{action}", state_dir, management)
    typer.echo(f"{name}: {acted(action, doc)}")


@app.command("start")
def start(
    name: Annotated[str, typer.Argument(help="The deployment's name.")],
    state_dir: StateOpt = None,
    management: ManagementOpt = None,
) -> None:
    """Start a launched deployment (after an operator stop, or for activation: explicit)."""
    _act("start", name, state_dir, management)


@app.command("stop")
def stop(
    name: Annotated[str, typer.Argument(help="The deployment's name.")],
    state_dir: StateOpt = None,
    management: ManagementOpt = None,
) -> None:
    """Stop a launched deployment and keep it stopped: requests get 409 until a start."""
    _act("stop", name, state_dir, management)


@app.command("park")
def park(
    name: Annotated[str, typer.Argument(help="The deployment's name.")],
    state_dir: StateOpt = None,
    management: ManagementOpt = None,
) -> None:
    """Park a launched deployment (a stop on these engines); the next request starts it."""
    _act("park", name, state_dir, management)


from ._cli_machines import register  # noqa: E402

register(app, state_path, fail)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
