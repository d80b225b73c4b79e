"""What the CLI's commands share: addresses, sockets, the open-file limit, the bounds of the
listeners other than the public one."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import os
import socket
import ssl
from pathlib import Path
from urllib.parse import quote

import typer
from aiohttp import web

from ._config import ConfigError
from ._config.parts import KEEPALIVE_TIMEOUT_S
from ._gateway import Gateway
from ._http.server import BoundedRunner, Limits
from ._http.tls import TLSSite
from ._management.api import create_management_app, create_metrics_app
from ._workers.worker import bound

__all__ = [
    "CONTROL_MAX_CONNECTIONS",
    "DEFAULT_MANAGEMENT",
    "DEFAULT_STATE",
    "GC_THRESHOLDS",
    "HEAD_TIMEOUT_S",
    "INGRESS_MAX_CONNECTIONS",
    "KEEPALIVE_TIMEOUT_S",
    "LOCAL_MAX_CONNECTIONS",
    "TLS_HANDSHAKE_TIMEOUT_S",
    "address",
    "bind",
    "bounded",
    "path_segment",
    "enough_files",
    "fail",
    "files_wanted",
    "local_runners",
    "management_address",
    "settle_heap",
    "state_path",
    "use_uvloop",
]

DEFAULT_MANAGEMENT = "127.0.0.1:7443"
DEFAULT_STATE = Path("~/.local/state/capyctl")
GC_THRESHOLDS = (10_000, 10, 10)
"""The cycle collector's generation thresholds once serving (Python's are 700, 10, 10)."""

# The listeners beside the public one (which has ``limits:`` in the configuration).
HEAD_TIMEOUT_S = 10.0
"""A connection whose request head is not whole this long after it opened is closed."""
LOCAL_MAX_CONNECTIONS = 64
"""Connections open at once to the management listener, and to the metrics listener."""
CONTROL_MAX_CONNECTIONS = 256
"""Connections open at once to a server's control port, those in their TLS handshake included."""
INGRESS_MAX_CONNECTIONS = 1024
"""Connections open at once to a host's ingress (it forwards 256 requests at once)."""
TLS_HANDSHAKE_TIMEOUT_S = 10.0
"""A connection to the control port that has not finished its TLS handshake by then is closed."""
LISTEN_BACKLOG = 4096
"""Every listener's queue of connections the kernel took and the listener has not accepted yet:
above every cap, so that a burst of connections meets the listener's cap, timeouts and 503 at
once, not seconds later when the kernel retries a connection its full queue dropped (with 128,
1,000 connects at once to an ingress left 3 neither answered nor closed after 25 s). The
kernel clamps it to ``net.core.somaxconn``."""


def bounded(
    app: web.Application,
    listener: str,
    max_connections: int,
    header_timeout: float = HEAD_TIMEOUT_S,
    *,
    keepalive_timeout: float = KEEPALIVE_TIMEOUT_S,
    busy_headers: bytes = b"",
    **kwargs: object,
) -> BoundedRunner:
    """A runner for ``app`` whose connections are bounded (`BoundedRunner`); ``listener``
    names it in the log."""
    limits = Limits(
        max_connections=max_connections,
        header_timeout=header_timeout,
        keepalive_timeout=keepalive_timeout,
        listener=listener,
        busy_headers=busy_headers,
    )
    return BoundedRunner(app, limits=limits, **kwargs)


def listen_site(runner: web.BaseRunner, sock: socket.socket) -> web.SockSite:
    """Where a plain-HTTP listener is served: ``sock``, with `LISTEN_BACKLOG`."""
    return web.SockSite(runner, sock, backlog=LISTEN_BACKLOG)


def control_site(runner: web.AppRunner, sock: socket.socket, context: ssl.SSLContext) -> TLSSite:
    """Where the server's control listener is served: TLS, each handshake within
    `TLS_HANDSHAKE_TIMEOUT_S`."""
    return TLSSite(
        runner,
        sock,
        ssl_context=context,
        handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S,
        backlog=LISTEN_BACKLOG,
    )


def local_runners(gateway: Gateway) -> tuple[web.AppRunner, web.AppRunner]:
    """The runners of the management listener and of the metrics listener (idle keep-alive
    bounded by the configuration's ``limits.keepalive_timeout``)."""
    idle = gateway.config.limits.keepalive_timeout
    return (
        bounded(
            create_management_app(gateway),
            "management listener",
            LOCAL_MAX_CONNECTIONS,
            keepalive_timeout=idle,
        ),
        bounded(
            create_metrics_app(gateway),
            "metrics listener",
            LOCAL_MAX_CONNECTIONS,
            keepalive_timeout=idle,
        ),
    )


def files_wanted(public_connections: int) -> int:
    """Open files a server or single gateway may need: two per public connection (its engine
    connection too), the other listeners' caps, and some room."""
    return 2 * public_connections + CONTROL_MAX_CONNECTIONS + 2 * LOCAL_MAX_CONNECTIONS + 256


def address(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{flag} takes HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104 - the documented default


def state_path(state_dir: Path | None) -> Path:
    """The state directory: ``--state-dir``, else ``CAPYCTL_STATE_DIR``, else `DEFAULT_STATE`."""
    return (state_dir or Path(os.environ.get("CAPYCTL_STATE_DIR") or DEFAULT_STATE)).expanduser()


def management_address(value: str | None) -> tuple[str, int]:
    """The management listener's address (``--management``, else ``CAPYCTL_MANAGEMENT_ADDR``,
    else `DEFAULT_MANAGEMENT`); it stays on loopback."""
    host, port = address(
        value or os.environ.get("CAPYCTL_MANAGEMENT_ADDR") or DEFAULT_MANAGEMENT, "--management"
    )
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise ConfigError(f"the management endpoint stays on loopback; {host} is not")
    return host, port


def fail(message: str) -> typer.Exit:
    """Say what went wrong on stderr; the exit (status 2) for the command to raise."""
    typer.echo(f"capyctl-gateway: {message}", err=True)
    return typer.Exit(2)


def enough_files(wanted: int) -> None:
    """Raise the soft open-file limit towards ``wanted`` (each client connection may hold an
    engine connection too), as far as the hard limit allows; say so when it falls short."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < wanted:
        typer.echo(
            f"capyctl-gateway: the open-file limit is {target}, under the {wanted} that "
            "limits.max_connections asks for: lower it, or raise the limit (ulimit -n)",
            err=True,
        )


def bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A socket bound to ``host:port``; ``reuse_port``: with ``SO_REUSEPORT``, for workers
    that each bind the same port. The port is first bound without it, so that a port another
    program (another gateway's workers included) holds is refused, never shared."""
    try:
        if reuse_port:
            with bound(host, port) as probe:
                port = probe.getsockname()[1]
        return bound(host, port, reuse_port=reuse_port)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def use_uvloop() -> None:
    """Run the event loop on uvloop where it is installed (it is, on Linux and macOS)."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def settle_heap() -> None:
    """Once the process serves: what it allocated to start (modules, configuration, the apps)
    lives as long as it does, so the cycle collector stops walking it (``gc.freeze``), and it
    looks at young objects every 10,000 allocations instead of 700 (the older generations at
    Python's own ratios). Requests free their objects by reference counting; the collector took
    2.7% of the gateway's CPU under load before, about 1% after (``docs/performance.md``). At
    most the cycles of 10,000 allocations wait for it (about a megabyte)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def path_segment(name: str) -> str:
    """``name`` as one segment of a URL's path: a model ID's ``/`` (and any character that
    is not plain) escaped, as the console's ``encodeURIComponent`` does."""
    return quote(name, safe="")
