from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from canopyx_provider import ProviderOptions
from capyctl_gateway import GATEWAY_KEY, Gateway, GatewayConfig, GatewayRunner, create_app
from capyctl_gateway._runners import KINDS
from tests.gateway.fake_engine import FakeEngine
from tests.gateway.fake_runner import FakeEngines, fake_kinds
from tests.gateway.serving import serve_workers
from tests.vclock import VirtualLoop

KEY = "k" * 43
NO_GPU = Path("/nonexistent-capyctl-devices")
"""Where the gateway's GPU probe looks in tests: nothing, so that a test machine's GPU does not
change what park: auto does (pass ``devices`` to make_gateway to give it one)."""
# The gateway's collector polls the fake engines quickly, and tries each startup check once.
COLLECTOR = ProviderOptions(poll_interval_ms=50, request_timeout_ms=2000, connect_attempts=1)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # aiohttp runs on asyncio only


async def _serve(app: web.Application, *, gateway: bool = False) -> tuple[web.AppRunner, str]:
    if gateway:
        runner: web.AppRunner = GatewayRunner(app)
    else:  # the fake engine notices hang-ups the same way
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = runner.addresses[0]
    return runner, f"http://{server[0]}:{server[1]}"


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = FakeEngine()
    app = web.Application(client_max_size=128 * 2**20)  # as an engine: no small body limit
    fake.routes(app)
    runner, fake.url = await _serve(app)
    try:
        yield fake
    finally:
        await runner.cleanup()


@dataclass
class Gw:
    url: str
    key: str
    gateway: Gateway
    fakes: FakeEngines | None = None
    """The fake runner's engines, when the test runs its engines on it."""

    def client(self, **kw: Any) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.key}"}
        kw.setdefault("timeout", 30)
        return httpx.AsyncClient(base_url=self.url, headers=headers, **kw)


def deployments(engine_url: str, **over: Any) -> dict[str, Any]:
    dep = {
        "name": "my-model",
        "engine": "vllm",
        "engine_version": "0.31.0",
        "served_model": "tiny",
        "instances": [{"url": engine_url}],
    }
    dep.update(over)
    return dep


@pytest.fixture
def workers() -> int:
    """How many worker processes' worth of listeners a test's gateways have: 1 (the process
    serves its public listener itself); a module that runs with several too overrides this
    fixture (``WORKERS``)."""
    return 1


WORKERS = pytest.fixture(params=[1, 2], ids=["one", "workers2"])(lambda request: request.param)
"""Put ``workers = WORKERS`` in a module to run each of its tests with one process and with
two workers behind an authority (in this process, over real Unix socket lines)."""
ONE = pytest.mark.parametrize("workers", [1], ids=["one"])
"""For a test, in a module with ``WORKERS``, of what one process holds itself (its engine
connections' pool): with workers each holds its own."""


@pytest.fixture
def fakes() -> FakeEngines | None:
    """The fake runner's engines for a test's gateways: None, so engines run as real processes
    on this machine; a module of the lifecycle's policy tests puts ``fakes = FAKES`` in it to
    run them on the fake runner (``fake_runner.py``) instead."""
    return None


FAKES = pytest.fixture(lambda: FakeEngines())
"""Put ``fakes = FAKES`` in a module to run its launched engines on the fake runner."""
VIRTUAL_CLOCK = pytest.fixture(lambda: ("asyncio", {"loop_factory": VirtualLoop}))
"""Put ``anyio_backend = VIRTUAL_CLOCK`` in a module whose engines and clients all run in the
test's process (the fake runner's, the fake engine): its tests run on the virtual clock
(``tests/vclock.py``), every timeout at its configured length and idle time passing at once."""


@pytest.fixture
async def make_gateway(
    workers: int, fakes: FakeEngines | None
) -> AsyncIterator[Callable[..., Awaitable[Gw]]]:
    """Start gateways from config dicts on loopback ports; all are stopped after the test."""
    stops: list[Callable[[], Awaitable[None]]] = []

    async def make(
        config: dict[str, Any],
        *,
        env: dict[str, str] | None = None,
        collector: ProviderOptions | None = None,
        devices: Path = NO_GPU,
        engine_logs: Path | None = None,
    ) -> Gw:
        app = create_app(
            GatewayConfig.model_validate(config, context={"devices": devices}),
            KEY,
            env=env or {},
            collector_options=collector or COLLECTOR,
            engine_logs=engine_logs,
            runners=KINDS if fakes is None else fake_kinds(fakes),
        )
        if workers > 1:
            stop, url = await serve_workers(app, workers)
            stops.append(stop)
            return Gw(url, KEY, app[GATEWAY_KEY], fakes)
        runner, url = await _serve(app, gateway=True)
        stops.append(runner.cleanup)
        return Gw(url, KEY, app[GATEWAY_KEY], fakes)

    try:
        yield make
    finally:
        for stop in stops:
            await stop()


@pytest.fixture
async def gateway(engine: FakeEngine, make_gateway: Callable[..., Awaitable[Gw]]) -> Gw:
    """A gateway with a vLLM chat deployment, a llama.cpp one and a decisions one, all on
    the fake engine."""
    return await make_gateway(
        {
            "deployments": [
                deployments(engine.url),
                deployments(engine.url, name="llama", engine="llamacpp", engine_version="b10798"),
                deployments(
                    engine.url,
                    name="decider",
                    api="decisions",
                    engine="tensorfold",
                    engine_version="0.6.1",
                ),
            ]
        }
    )


@pytest.fixture
def tmp_config(tmp_path: Path) -> Callable[[str], Path]:
    def write(text: str) -> Path:
        p = tmp_path / "gateway.yaml"
        p.write_text(text)
        return p

    return write


@pytest.fixture
def unresponsive() -> Iterator[str]:
    """A loopback port whose listen queue is full: a connection to it is never established
    (the kernel drops the SYN), as with an engine host that has stopped answering."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    fillers = []
    for _ in range(4):  # fill the accept queue; the rest of the connects stay pending
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(server.getsockname())
        fillers.append(s)
    host, port = server.getsockname()
    try:
        yield f"http://{host}:{port}"
    finally:
        for s in fillers:
            s.close()
        server.close()
