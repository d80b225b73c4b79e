"""The gateway's frame: the runner it must be served by, request IDs on every answer, the
public API, the text status, and the exchange's mapping of what goes wrong."""

from __future__ import annotations

import importlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from aiohttp import web
from rich.console import Console

from capyctl_gateway import GatewayConfig, create_app
from capyctl_gateway._management.render import print_status
from tests.gateway.conftest import KEY, Gw, deployments
from tests.gateway.fake_engine import FakeEngine, Hold, Pause, chunk, event

pytestmark = pytest.mark.anyio
CHAT = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}]}
MakeGateway = Callable[..., Awaitable[Gw]]


# -- the runner --------------------------------------------------------------------------
async def test_the_application_refuses_a_runner_that_would_miss_hang_ups() -> None:
    config = GatewayConfig.model_validate({"deployments": [deployments("http://127.0.0.1:9")]})
    app = create_app(config, KEY, env={})
    runner = web.AppRunner(app)  # handler_cancellation defaults to False
    with pytest.raises(RuntimeError, match="GatewayRunner"):
        await runner.setup()
    await runner.cleanup()


# -- request IDs on every answer ---------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/systemone"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/my-model"),
        ("GET", "/v1/models/nobody"),  # the key first: no model name is told to a stranger
    ],
)
async def test_a_401_hands_back_the_callers_id_and_carries_ours(
    gateway: Gw, engine: FakeEngine, method: str, path: str
) -> None:
    async with gateway.client() as c:
        r = await c.request(
            method,
            path,
            json=CHAT,
            headers={"Authorization": "Bearer wrong", "X-Request-Id": "mine-1"},
        )
    assert r.status_code == 401
    assert r.json()["code"] == "unauthorized"
    assert r.headers["x-request-id"] == "mine-1"
    assert r.headers["x-capyctl-request-id"]
    assert engine.received == []


async def test_an_invalid_caller_id_without_the_key_is_still_401(gateway: Gw) -> None:
    async with gateway.client() as c:
        r = await c.post(
            "/v1/chat/completions",
            json=CHAT,
            headers={"Authorization": "Bearer wrong", "X-Request-Id": "has space"},
        )
    assert r.status_code == 401
    assert "x-request-id" not in r.headers


async def test_unknown_routes_and_methods_carry_a_request_id(gateway: Gw) -> None:
    async with gateway.client() as c:
        missing = await c.get("/v2/nothing")
        wrong = await c.get("/v1/chat/completions")
    assert (missing.status_code, missing.json()["code"]) == (404, "not_found")
    assert (wrong.status_code, wrong.json()["code"]) == (405, "method_not_allowed")
    assert missing.headers["x-capyctl-request-id"] and wrong.headers["x-capyctl-request-id"]


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("/v1/models/a%0Ab", "unknown_model"),  # a model name with a line break in it
        ("/v2/a%0Ab", "not_found"),
        ("/v1/responses/resp%0A1", "not_found"),
    ],
)
async def test_a_path_with_a_line_break_is_ours_to_answer(
    gateway: Gw, path: str, code: str
) -> None:
    """The routes' patterns did not match a decoded line break (``.`` stops at one), so such a
    path fell to aiohttp's own 404: no request ID, not our error's shape (found by the OpenAPI
    fuzzing)."""
    async with gateway.client() as c:
        r = await c.get(path, headers={"X-Request-Id": "nl-1"})
    assert (r.status_code, r.json()["code"]) == (404, code)
    assert r.headers["x-capyctl-request-id"] and r.headers["x-request-id"] == "nl-1"


# -- errors are per request --------------------------------------------------------------
async def test_each_unauthorised_request_gets_its_own_error(gateway: Gw) -> None:
    # A shared exception instance would carry one request's traceback into the next one's.
    async with gateway.client() as c:
        rids = {
            (await c.get("/v1/models", headers={"Authorization": "x"})).headers[
                "x-capyctl-request-id"
            ]
            for _ in range(3)
        }
    assert len(rids) == 3


# -- the public API ----------------------------------------------------------------------
def test_the_gateways_all_is_sorted_and_resolves() -> None:
    mod = importlib.import_module("capyctl_gateway")
    names = list(mod.__all__)
    assert names == sorted(names)
    # dir(): the names it holds and those it imports on first use (PEP 562)
    public = {n for n in dir(mod) if not n.startswith("_")} - {"annotations", "cli"}
    assert public == set(names)
    for name in names:
        obj = getattr(mod, name)
        assert obj is not None, name
        if isinstance(obj, type):
            assert obj.__module__.startswith("capyctl_gateway."), (name, obj.__module__)


# -- the text status -----------------------------------------------------------------------
@pytest.mark.parametrize("width", [40, 80])
def test_status_text_never_cuts_a_url_short(width: int) -> None:
    url = "http://127.0.0.1:18001"
    long_url = "http://an-engine-host-with-a-long-name.internal.example:18002"
    doc: dict[str, Any] = {
        "deployment": {
            "name": "my-model",
            "id": "01KBG3W8Q2ZN",
            "api": "chat",
            "engine": "vllm",
            "engine_version": "0.31.0",
            "served_model": "tiny",
            "state": "ready",
            "running": 0,
            "waiting": 0,
        },
        "instances": [
            {
                "index": i,
                "url": u,
                "host": u.split("//")[1].split(":")[0],
                "machine": u.split("//")[1].split(":")[0],
                "state": "failed",
                "running": None,
                "waiting": None,
                "snapshot_age_s": None,
                "router_running": 0,
                "cancelled": [],
                "error": "served model mismatch: the engine serves 'other'",
            }
            for i, u in enumerate((url, long_url))
        ],
    }
    console = Console(width=width, record=True, force_terminal=False, highlight=False)
    print_status(console, doc)
    text = console.export_text()
    assert url in text and long_url in text
    assert "served model mismatch: the engine serves 'other'" in text


# -- what the exchange maps -----------------------------------------------------------------
async def test_pings_alone_do_not_keep_a_stream_alive(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    # One token, then only keep-alive comments, more often than the idle timeout: the
    # client must get the idle timeout, not wait for as long as the engine pings.
    pings: list[Any] = []
    for _ in range(40):
        pings += [Pause(0.05), b": ping\n\n"]
    engine.script = [
        event(chunk(delta={"role": "assistant", "content": ""})),
        event(chunk(delta={"content": "x"})),
        *pings,
        Hold(),
    ]
    gw = await make_gateway(
        {"queue": {"stream_idle_timeout": "300ms"}, "deployments": [deployments(engine.url)]}
    )
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(data[-1])["error"]["code"] == "unavailable"
    with anyio.fail_after(5):
        await engine.hung_up.wait()
    # Cut while the engine was still pinging: it never reached the end of its script.
    assert engine.finished == 0
    cut = gw.gateway.fleet.settlement.ledgers["my-model/0"].cut
    assert [c.reason for c in cut] == ["idle_timeout"]


async def test_an_engine_redirect_is_an_engine_error_and_never_followed(
    engine: FakeEngine, make_gateway: MakeGateway
) -> None:
    from tests.gateway.fake_engine import Reply

    engine.script = Reply(307, b"", content_type="text/plain")
    gw = await make_gateway({"deployments": [deployments(engine.url)]})
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert (r.status_code, r.json()["code"]) == (502, "engine_error")
    assert len(engine.received) == 1  # one POST, not a chain of them


async def test_client_messages_never_carry_an_engine_address(make_gateway: MakeGateway) -> None:
    dep = deployments("http://127.0.0.1:9")  # the discard port: nothing listens
    gw = await make_gateway({"deployments": [dep]})
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert (r.status_code, r.json()["code"]) == (502, "engine_error")
    assert "127.0.0.1" not in r.text and ":9" not in r.text
    assert "my-model" in r.json()["message"]


@pytest.mark.parametrize("stream", [True, False])
async def test_an_engines_own_error_words_reach_the_log_not_the_client(
    engine: FakeEngine, make_gateway: MakeGateway, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    engine.script = [
        event(chunk(delta={"role": "assistant", "content": ""})),
        event(chunk(delta={"content": "x"})),
        event({"error": {"code": 500, "message": "engine OOM on /dev/nvidia0"}}),
        Hold(),
    ]
    gw = await make_gateway({"deployments": [deployments(engine.url)]})
    async with gw.client() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert "nvidia0" not in r.text
    assert "the engine sent an error event" in r.text
    assert any("engine OOM on /dev/nvidia0" in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize("writing", [True, False])
def test_a_reset_while_writing_to_the_client_is_a_hang_up_not_an_engine_failure(
    writing: bool,
) -> None:
    # aiohttp's ClientConnectionResetError ("Cannot write to closing transport") is both a
    # ClientError and a ConnectionResetError: only while we write to the client is it theirs.
    import aiohttp
    from yarl import URL

    from capyctl_gateway._errors import ClientGoneError, EngineError
    from capyctl_gateway._relay.ending import _failure
    from capyctl_gateway._relay.exchange import Exchange

    ex = Exchange(
        None,  # type: ignore[arg-type]  # the mapping never touches the session
        URL("http://127.0.0.1:1"),
        {},
        where="deployment m, instance 0",
        deadline=0.0,
        idle_timeout=1.0,
        drains=set(),
    )
    ex.writing = writing
    mapped = _failure(ex, aiohttp.ClientConnectionResetError("Cannot write to closing transport"))
    if writing:
        assert isinstance(mapped, ClientGoneError) and ex.outcome.cut == "hang_up"
    else:
        assert isinstance(mapped, EngineError) and ex.outcome.cut is None


async def test_every_path_refuses_other_methods_with_405_and_hands_back_the_callers_id(
    gateway: Gw,
) -> None:
    async with gateway.client() as c:
        for method, path, allow in (
            ("POST", "/v1/models", "GET"),
            ("DELETE", "/v1/models/my-model", "GET"),
            ("POST", "/v1/models/nobody", "GET"),
            ("DELETE", "/openapi.json", "GET"),
            ("GET", "/v1/systemone", "POST"),
        ):
            r = await c.request(method, path, headers={"X-Request-Id": "mine-405"})
            assert (r.status_code, r.json()["code"]) == (405, "method_not_allowed"), path
            assert r.headers["allow"] == allow
            assert r.headers["x-request-id"] == "mine-405" and r.headers["x-capyctl-request-id"]
        missing = await c.get("/nowhere", headers={"X-Request-Id": "mine-404"})
    assert missing.status_code == 404 and missing.headers["x-request-id"] == "mine-404"


def test_each_engine_kind_that_can_sleep_says_how_it_parks() -> None:
    """The engine facts table: a kind that can park with its process up names its driver,
    and each figures object it names is one the verifier keeps."""
    from capyctl_gateway._deployments.parking import _DRIVERS
    from capyctl_gateway._engines import FACTS, FIGURE_OBJECTS
    from capyctl_gateway._relay.figures import _ENGINE_FIGURES

    for kind, f in FACTS.items():
        assert f.can_sleep == (f.park_by is not None), kind
        assert f.park_by is None or f.park_by in _DRIVERS, kind
        assert f.figures_in is None or f.figures_in in _ENGINE_FIGURES, kind
    assert set(FIGURE_OBJECTS) == set(_ENGINE_FIGURES)
