"""What the CLI's commands share: addresses, sockets, the open-file limit."""

from __future__ import annotations

import asyncio
import gc
import socket

import typer

from ._config import ConfigError

__all__ = ["GC_THRESHOLDS", "address", "bind", "enough_files", "settle_heap", "use_uvloop"]

GC_THRESHOLDS = (10_000, 10, 10)
"""The cycle collector's generation thresholds once serving (Python's are 700, 10, 10)."""


def address(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{flag} takes HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104 - the documented default


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


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


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
