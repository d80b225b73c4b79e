"""The fake engine as a process the gateway can launch: ``python -m
tests.gateway.launchable_engine --served NAME [engine flags] --host H --port P``.

It answers every request with the same short vLLM-shaped stream (its text names the served
model, so a test can tell which deployment answered). A request whose last message is
``take:S`` is a long generation: S seconds pass between its first chunk and the rest (while it
runs the engine reports it in ``vllm:num_requests_running``); one whose last message is
``crash`` makes the engine exit with status 3 after its first chunk; with
``--garbled-after-wake`` it answers differently once woken (weights brought back wrong). Flags it does not know, such as the ones
the gateway forces, are accepted and ignored; ``--exit-at-once N`` exits with status N before
listening, and ``--slow-start S`` waits S seconds first. It prints its arguments first, as vLLM
does (keys included); ``--echo-env NAME`` prints that variable's value too, and ``--chatty
BYTES`` writes that much output as fast as it can before it listens, then how long it took;
``--metrics-down`` answers ``/metrics`` 503 (it fails the collector's metrics check).

Launched with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``, it speaks vLLM's sleep
mode routes as vLLM 0.31.0 does (``POST /sleep?level=1``, ``POST /wake_up``, ``GET
/is_sleeping``); launched with ``--enable-memory-saver``, SGLang's (``POST
/release_memory_occupation`` and ``/resume_memory_occupation``, JSON ``{"tags": [...]}``). Asleep
or released, it answers chat requests 503, so a test shows the gateway woke it first.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

from aiohttp import web

from tests.gateway.fake_engine import DONE, FakeEngine, chunk, event


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--served", default="tiny")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--exit-at-once", type=int, default=None)
    p.add_argument("--slow-start", type=float, default=0.0)
    p.add_argument("--child-pid-file", default=None, help="fork a child, as vLLM does")
    p.add_argument("--stray-pid-file", default=None, help="fork a child that leaves the group")
    p.add_argument("--garbled-after-wake", action="store_true", help="answer wrong once woken")
    p.add_argument("--ignore-sigterm", action="store_true", help="linger until SIGKILL")
    p.add_argument("--lock-file", default=None, help="exit 9 if another engine holds it")
    p.add_argument("--echo-env", default=None)
    p.add_argument("--chatty", type=int, default=0)
    p.add_argument("--metrics-down", action="store_true", help="/metrics answers 503")
    p.add_argument("--max-running", type=int, default=None, help="run at most N at once")
    return p


def main(argv: list[str] | None = None) -> None:
    args, unknown = parser().parse_known_args(argv)
    sys.stdout.write(f"fake engine args: {sys.argv[1:]}\n")
    if args.echo_env:
        sys.stdout.write(f"fake engine: loaded {os.environ.get(args.echo_env)}\n")
    sys.stdout.flush()
    if args.chatty:
        chatter(args.chatty)
    if args.ignore_sigterm:
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.lock_file:  # one engine at a time may hold it (a GPU's memory, say)
        import fcntl

        held = open(args.lock_file, "w")  # noqa: SIM115 (held until the process ends)
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            sys.stdout.write("fake engine: another engine still holds the lock\n")
            sys.exit(9)
    if args.exit_at_once is not None:
        sys.stdout.write(f"fake engine: exiting with {args.exit_at_once} as asked\n")
        sys.exit(args.exit_at_once)
    if args.child_pid_file:
        import subprocess

        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        with open(args.child_pid_file, "w") as f:
            f.write(str(child.pid))
    if args.stray_pid_file:
        import subprocess

        stray = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True
        )
        with open(args.stray_pid_file, "w") as f:
            f.write(str(stray.pid))
    if args.slow_start:
        time.sleep(args.slow_start)  # an engine loading its weights

    def crash() -> None:
        sys.stdout.write("fake engine: crashing as asked\n")
        sys.stdout.flush()
        os._exit(3)

    sleeps = "--enable-sleep-mode" in unknown and os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
    app, _ = build_app(
        args.served,
        crash=crash,
        garbled_after_wake=args.garbled_after_wake,
        sleep_routes=sleeps,
        memory_saver="--enable-memory-saver" in unknown,
        metrics_served=not args.metrics_down,
        max_running=args.max_running,
    )
    sys.stdout.write(f"fake engine serving {args.served} on {args.host}:{args.port}\n")
    sys.stdout.flush()
    web.run_app(
        app,
        host=args.host,
        port=args.port,
        print=None,
        handler_cancellation=True,
        handle_signals=not args.ignore_sigterm,  # aiohttp's own SIGTERM handler would stop it
    )


class Sleep:
    """Whether the engine is asleep (or released), and whether it came back wrong."""

    asleep = False
    garbled = False


def build_app(
    served: str,
    *,
    crash: Any,
    garbled_after_wake: bool = False,
    sleep_routes: bool = False,
    memory_saver: bool = False,
    metrics_served: bool = True,
    max_running: int | None = None,
) -> tuple[web.Application, Sleep]:
    """The engine's application: what ``main`` serves in its own process, and what the fake
    runner (``fake_runner.py``) serves in the test's. ``crash()`` is called after the first
    chunk of a request that says ``crash``. ``max_running``: requests beyond it wait (in
    ``vllm:num_requests_waiting``) until one ends, as vLLM's ``--max-num-seqs``."""
    script = [
        event(chunk(delta={"role": "assistant", "content": ""}, model=served)),
        event(chunk(delta={"content": f"from {served}"}, model=served)),
        event(chunk(delta={}, finish="stop", model=served)),
        DONE,
    ]
    engine = FakeEngine(served=served, script=script)
    engine.metrics_served = metrics_served
    app = web.Application()
    state = Sleep()
    seats = asyncio.Semaphore(max_running) if max_running is not None else None

    async def sleep(request: web.Request) -> web.Response:
        if request.query.get("level") != "1":
            return web.Response(status=400)
        state.asleep = True
        return web.Response()

    async def wake_up(request: web.Request) -> web.Response:
        state.asleep = False
        state.garbled = garbled_after_wake
        return web.Response()

    async def is_sleeping(request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": state.asleep})

    @web.middleware
    async def refuse_asleep(request: web.Request, handler: Any) -> web.StreamResponse:
        if state.asleep and request.path == "/v1/chat/completions":
            return web.Response(status=503, text="asleep")
        response: web.StreamResponse = await handler(request)
        return response

    app.middlewares.append(refuse_asleep)

    async def release(request: web.Request) -> web.Response:
        body = await request.json()
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "not an object"}}, status=400)
        state.asleep = True
        return web.json_response(None)

    async def resume(request: web.Request) -> web.Response:
        state.asleep = False
        return web.json_response(None)

    if memory_saver:
        app.router.add_post("/release_memory_occupation", release)
        app.router.add_post("/resume_memory_occupation", resume)
    if sleep_routes:
        app.router.add_post("/sleep", sleep)
        app.router.add_post("/wake_up", wake_up)
        app.router.add_get("/is_sleeping", is_sleeping)

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        said = str(body["messages"][-1].get("content", ""))
        if seats is not None and seats.locked():
            engine.waiting += 1
            try:
                await seats.acquire()
            finally:
                engine.waiting -= 1
        elif seats is not None:
            await seats.acquire()
        try:
            return await run(request, body, said)
        finally:
            if seats is not None:
                seats.release()

    async def run(request: web.Request, body: Any, said: str) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        engine.running += 1
        try:
            await out.write(script[0])
            if said == "crash":
                crash()
                return out
            if said.startswith("take:"):
                await asyncio.sleep(float(said.removeprefix("take:")))
            if state.garbled:
                await out.write(event(chunk(delta={"content": "from n0where"}, model=served)))
            for item in script[1 + state.garbled : -1]:
                await out.write(item)
            if (body.get("stream_options") or {}).get("include_usage"):  # as engines count
                usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
                await out.write(event(chunk(choices=[], usage=usage, model=served)))
            await out.write(DONE)
            await out.write_eof()
        finally:
            engine.running -= 1
        return out

    app.router.add_post("/v1/chat/completions", chat)
    engine.routes(app)
    return app, state


def chatter(total: int) -> None:
    """Write ``total`` bytes of lines to stdout as fast as it can, then say how long it took."""
    line = b"fake engine: chatter " + b"." * 42 + b"\n"
    block = line * (65536 // len(line))
    out = sys.stdout.buffer
    began = time.perf_counter()
    left = total
    while left > 0:
        left -= out.write(block[:left])
    out.flush()
    took = time.perf_counter() - began
    out.write(f"fake engine: chatty wrote {total} bytes in {took:.3f} s\n".encode())
    out.flush()


if __name__ == "__main__":
    main()
