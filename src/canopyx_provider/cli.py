"""``canopyx-provider``: check, watch and simulate against a live engine."""

from __future__ import annotations

import contextlib
import os
import time
from decimal import Decimal, InvalidOperation
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import anyio
import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from ._collector import Collector, EngineStatus
from ._errors import ConfigError
from ._keys import engine_api_key
from ._link import InProcessLink
from ._options import ProviderOptions
from ._pricing import LoadAndAdmission, Price
from ._provider import Provider
from ._simulate import quote_table, started
from ._snapshot import CheckReport, EngineKind
from .adapters import EngineAdapter, adapter_for

app = typer.Typer(
    name="canopyx-provider",
    help="Check, watch and price a local inference engine the way the Canopy connector does.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

#: The distribution that ships ``canopyx_provider`` (and the gateway).
DISTRIBUTION = "canopyx"


def _version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"canopyx-provider {_version()}")
        raise typer.Exit()


@app.callback()
def _main(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the version and exit.",
        ),
    ] = False,
) -> None:
    """Check, watch and price a local inference engine the way the Canopy connector does."""


EngineOpt = Annotated[EngineKind, typer.Option("--engine", help="The engine's kind.")]
BaseUrlOpt = Annotated[str, typer.Option("--base-url", help="The engine's origin.")]
ModelOpt = Annotated[str, typer.Option("--model", help="The engine model ID.")]
LabelOpt = Annotated[
    list[str] | None, typer.Option("--label", help="K=V label selecting one engine (repeatable).")
]
MetricsUrlOpt = Annotated[str | None, typer.Option("--metrics-url", help="Scrape this URL.")]
KeyEnvOpt = Annotated[
    str | None,
    typer.Option("--api-key-env", help="Read the engine's API key from this variable."),
]
RouterOpt = Annotated[bool, typer.Option("--router", help="llama.cpp router mode.")]
SlotsOpt = Annotated[int | None, typer.Option("--slots", help="llama.cpp slots if /props is off.")]
IntervalOpt = Annotated[
    int, typer.Option("--poll-interval-ms", min=50, help="Pause between polls, in ms.")
]
TimeoutOpt = Annotated[
    int,
    typer.Option("--request-timeout-ms", min=50, help="Bound on one collection cycle, in ms."),
]


def _adapter(
    engine: EngineKind,
    base_url: str,
    labels: list[str] | None,
    metrics_url: str | None,
    api_key_env: str | None,
    router: bool,
    slots: int | None,
) -> EngineAdapter:
    parsed: dict[str, str] = {}
    for item in labels or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--label takes K=V, got {item!r}")
        parsed[key] = value
    if api_key_env is not None:
        api_key = os.environ.get(api_key_env) or None
        if api_key is None:
            raise ConfigError(f"--api-key-env {api_key_env}: the variable is not set")
    else:
        api_key = engine_api_key()
    try:
        return adapter_for(
            engine,
            base_url,
            api_key=api_key,
            labels=parsed,
            metrics_url=metrics_url,
            router=router,
            slots=slots,
        )
    except ConfigError as exc:
        # adapter_for decides which options an engine takes; this only words it in flags.
        if exc.option in ("router", "slots"):
            raise ConfigError("--router and --slots apply to --engine llamacpp only") from None
        if exc.option == "labels":
            raise ConfigError(f"--label does not apply to --engine {engine.value}") from None
        raise


def _fail(message: str) -> typer.Exit:
    Console(stderr=True).print(f"[red]error:[/red] {message}", highlight=False)
    return typer.Exit(2)


@app.command()
def check(
    engine: EngineOpt,
    base_url: BaseUrlOpt,
    model: ModelOpt,
    label: LabelOpt = None,
    metrics_url: MetricsUrlOpt = None,
    api_key_env: KeyEnvOpt = None,
    router: RouterOpt = False,
    slots: SlotsOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    request_timeout_ms: TimeoutOpt = 3000,
) -> None:
    """Run the startup checks once; exit 0 when every check passes, 1 otherwise."""
    try:
        adapter = _adapter(engine, base_url, label, metrics_url, api_key_env, router, slots)
        options = ProviderOptions(request_timeout_ms=request_timeout_ms)
    except (ConfigError, ValueError) as exc:
        raise _fail(str(exc)) from None

    async def run() -> CheckReport:
        async with Collector(options=options) as collector:
            collector.add("engine", adapter, model_id=model, poll=False)
            return await collector.check("engine")

    report = anyio.run(run)
    if as_json:
        typer.echo(report.to_json())
    else:
        _print_report(Console(highlight=False), adapter, model, report)
    raise typer.Exit(0 if report.ok else 1)


def _print_report(console: Console, adapter: EngineAdapter, model: str, r: CheckReport) -> None:
    console.print(f"{adapter.kind.value} at {adapter.base_url}, model {model!r}")
    table = Table("check", "result", "reason")
    for c in r.checks:
        table.add_row(c.name, "[green]ok[/green]" if c.ok else "[red]failed[/red]", c.reason or "")
    console.print(table)
    if r.engine_version is not None:
        console.print(f"engine version: {r.engine_version}")
    if r.capacity is not None:
        for k, v in r.capacity.figures().items():
            console.print(f"capacity {k}: {'; '.join(v) if isinstance(v, tuple) else v}")
    if r.metrics is not None:
        figures = r.metrics.figures()
        if not r.metrics.has_engine_load:
            console.print("metrics: this engine publishes no load (limited support)")
        for k, v in figures.items():
            console.print(f"metrics {k}: {v}")


@app.command()
def watch(
    engine: EngineOpt,
    base_url: BaseUrlOpt,
    model: ModelOpt,
    label: LabelOpt = None,
    metrics_url: MetricsUrlOpt = None,
    api_key_env: KeyEnvOpt = None,
    router: RouterOpt = False,
    slots: SlotsOpt = None,
    poll_interval_ms: IntervalOpt = 1000,
    request_timeout_ms: TimeoutOpt = 3000,
    count: Annotated[
        int | None, typer.Option("--count", min=1, help="Stop after this many polls.")
    ] = None,
) -> None:
    """A live table of the engine's snapshot and its age, refreshed every poll."""
    try:
        adapter = _adapter(engine, base_url, label, metrics_url, api_key_env, router, slots)
        options = ProviderOptions(
            poll_interval_ms=poll_interval_ms, request_timeout_ms=request_timeout_ms
        )
    except (ConfigError, ValueError) as exc:
        raise _fail(str(exc)) from None
    console = Console(highlight=False)

    async def run() -> None:
        async with Collector(options=options) as collector:
            collector.add("engine", adapter, model_id=model, poll=False)
            with contextlib.ExitStack() as stack:
                live = None
                if console.is_terminal:
                    live = stack.enter_context(Live(console=console, auto_refresh=False))
                polls = 0
                while count is None or polls < count:
                    await collector.refresh("engine")
                    polls += 1
                    table = _status_table(collector.status("engine"), time.time())
                    if live is not None:
                        live.update(table, refresh=True)
                    else:
                        console.print(table)
                    if count is None or polls < count:
                        await anyio.sleep(options.poll_interval_s)

    with contextlib.suppress(KeyboardInterrupt):
        anyio.run(run)


def _status_table(status: EngineStatus, now: float) -> Table:
    snap = status.latest
    title = f"{status.adapter.kind.value} {status.adapter.base_url} {status.model_id!r}"
    table = Table("figure", "value", title=title)
    table.add_row("state", status.state.value)
    if status.error:
        table.add_row("error", status.error)
    if snap is None:
        table.add_row("snapshot", "none (metrics unusable)")
        return table
    table.add_row("age", f"{snap.age_s(now):.2f} s" + ("" if status.fresh else " (stale)"))
    table.add_row("engine version", snap.engine_version or "unknown")
    if not snap.metrics.has_engine_load:
        table.add_row("load", "not published (limited support)")
    for k, v in snap.metrics.figures().items():
        table.add_row(k, f"{v:.4f}" if isinstance(v, float) and not v.is_integer() else str(v))
    if snap.capacity is not None:
        for k, v in snap.capacity.figures().items():
            table.add_row(f"capacity {k}", "; ".join(v) if isinstance(v, tuple) else str(v))
    return table


@app.command()
def simulate(
    engine: EngineOpt,
    base_url: BaseUrlOpt,
    model: ModelOpt,
    label: LabelOpt = None,
    metrics_url: MetricsUrlOpt = None,
    api_key_env: KeyEnvOpt = None,
    router: RouterOpt = False,
    slots: SlotsOpt = None,
    quotes: Annotated[int, typer.Option("--quotes", min=1, help="Quote requests to send.")] = 20,
    rate: Annotated[
        float, typer.Option("--rate", min=0.1, help="Quote requests per second.")
    ] = 4.0,
    price_in: Annotated[str, typer.Option("--price-in", help="List price, input $/Mtok.")] = "0.20",
    price_out: Annotated[
        str, typer.Option("--price-out", help="List price, output $/Mtok.")
    ] = "0.60",
    admission_target: Annotated[
        float,
        typer.Option("--admission-target", help="Admit up to this fraction (0..1] of capacity."),
    ] = 0.8,
    poll_interval_ms: IntervalOpt = 500,
) -> None:
    """Drive the load-and-admission strategy with synthetic quote traffic against a live engine."""

    try:
        adapter = _adapter(engine, base_url, label, metrics_url, api_key_env, router, slots)
        strategy = LoadAndAdmission(
            Price(Decimal(price_in), Decimal(price_out)), admission_target=admission_target
        )
        options = ProviderOptions(poll_interval_ms=poll_interval_ms)
    except (ConfigError, ValueError, InvalidOperation) as exc:
        raise _fail(str(exc)) from None
    console = Console(highlight=False)
    link = InProcessLink(model)
    provider = Provider(adapter, strategy, link, options=options)
    ok = True

    async def run() -> None:
        nonlocal ok
        async with anyio.create_task_group() as tg:
            tg.start_soon(provider.run)
            ok = await started(console, link, provider)
            if ok:
                await link.ready.wait()
                console.print(await quote_table(link, provider, model, quotes=quotes, rate=rate))
            tg.cancel_scope.cancel()

    with link:
        anyio.run(run)
    raise typer.Exit(0 if ok else 1)


def main() -> None:
    app()
