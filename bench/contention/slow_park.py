"""The launchable fake engine (``tests/gateway/launchable_engine.py``) whose park and wake take
time, as a real engine's do: ``python -m bench.contention.slow_park --slow-sleep P --slow-wake W
[the fake engine's flags]``. Launched with vLLM's sleep mode (``--enable-sleep-mode`` and
``VLLM_SERVER_DEV_MODE=1``, which the gateway adds for ``park: sleep``), ``POST /sleep`` answers
after P seconds and ``POST /wake_up`` after W; everything else is the fake engine's, its
``--slow-start`` (a start's cost) and ``take:S`` (a generation of S seconds) included."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from aiohttp import web
from tests.gateway import launchable_engine

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--slow-sleep", type=float, default=0.0)
    p.add_argument("--slow-wake", type=float, default=0.0)
    args, rest = p.parse_known_args(argv)
    delays = {"/sleep": args.slow_sleep, "/wake_up": args.slow_wake}
    build = launchable_engine.build_app

    def build_app(*a: Any, **k: Any) -> tuple[web.Application, launchable_engine.Sleep]:
        app, state = build(*a, **k)

        @web.middleware
        async def slow(request: web.Request, handler: Any) -> web.StreamResponse:
            delay = delays.get(request.path, 0.0)
            if delay and request.method == "POST":
                await asyncio.sleep(delay)  # the engine moving its weights
            response: web.StreamResponse = await handler(request)
            return response

        app.middlewares.append(slow)
        return app, state

    launchable_engine.build_app = build_app  # main() looks it up in its module
    launchable_engine.main(rest)


if __name__ == "__main__":
    main()
