"""The console in a real browser: headless Chromium (``bench/browser.py``) against a
gateway running a launched fake engine. The page lists the deployment, its stop and start
buttons move it, an event shows without a reload, and a wrong key is told plainly. Without
Chromium these tests skip, except under CI, where they fail."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from bench.browser import Browser, chromium

from capyctl_gateway._management.render import size
from tests.gateway.conftest import Gw
from tests.gateway.lifecycle.test_lifecycle import chat, launched
from tests.gateway.management.test_console import Console, console_of, launched_console  # noqa: F401
from tests.gateway.pods.test_pods import (
    NS,
    cluster,  # noqa: F401
    config,
    pod_deployment,
)
from tests.gateway.pods.test_pods import Cluster as PodCluster

pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]
CARD = '[data-deployment="my-model"]'


def enabled_are(*actions: str) -> str:
    """True once the card's enabled buttons are ``actions`` (the others disabled)."""
    found = f"[...document.querySelectorAll('{CARD} button[data-action]')]"
    return (
        f"JSON.stringify({found}.filter((b) => !b.disabled).map((b) => b.dataset.action))"
        f" === {json.dumps(json.dumps(list(actions), separators=(',', ':')))}"
        f" && {found}.length === 3"
    )


def state_is(text: str) -> str:
    sel = json.dumps(f'{CARD} [data-state="my-model"]')
    return f"document.querySelector({sel})?.textContent === {json.dumps(text)}"


@pytest.fixture
async def browser(
    make_gateway: MakeGateway,
    console_of: Callable[[Gw], Awaitable[Console]],  # noqa: F811
) -> AsyncIterator[Browser]:
    """Chromium, closed before the gateways and consoles it talks to (it asks for their
    fixtures, so they are set up before it and torn down after): no page of it can open a
    connection to a server while that server is being closed."""
    binary = chromium()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail(
                "chromium is not installed: scripts/system-packages installs Debian's package"
            )
        pytest.skip("chromium is not installed (apt-get install chromium)")
    b = Browser(binary)
    try:
        await b.start()
        yield b
    finally:
        await b.close()
        assert b.gone(), "chromium or its profile outlived the test"


async def test_the_page_lists_the_deployment_and_its_buttons_stop_and_start_it(
    browser: Browser,
    launched_console: Console,  # noqa: F811
) -> None:
    con = launched_console
    async with con.client() as c:  # what `capyctl console` asks for and prints
        ticket = (await c.post("/management/v1/console/tickets")).json()["ticket"]
    await browser.goto(f"{con.url}/#ticket={ticket}")
    await browser.until(f"!!document.querySelector('{CARD}')")
    assert await browser.js("location.hash") == ""  # the ticket left the address bar
    assert await browser.js("sessionStorage.getItem('capyctl-key')") == con.gw.key
    assert con.gw.key not in await browser.js("location.href")
    await browser.until(state_is("stopped"))
    # Only what would change something is enabled, and only that is clicked: stopped (the
    # next request starts it), a stop keeps it so; nothing to park.
    await browser.until(enabled_are("start", "stop"))
    await browser.click(f'{CARD} button[data-action="start"]')
    await browser.until(state_is("ready"), within=60)
    await browser.until(f"document.querySelector('{CARD} [data-answer]')?.textContent"
                        " === 'start: done, ready'")  # fmt: skip
    await browser.until(enabled_are("stop", "park"))  # it serves: nothing to start
    await browser.click(f'{CARD} button[data-action="stop"]')
    await browser.until(f"document.querySelector('{CARD} [data-answer]')?.textContent"
                        " === 'stop: done, stopped'", within=60)  # fmt: skip
    await browser.until(state_is("stopped by an operator"))
    await browser.until(enabled_are("start"))  # stopped and kept so: only a start means something
    doc = con.gw.gateway.fleet.lifecycle.lives["my-model"]
    assert doc.operator_stopped and doc.state == "stopped"
    await browser.click(f'{CARD} button[data-action="start"]')
    await browser.until(state_is("ready"), within=60)
    await browser.until(enabled_are("stop", "park"))
    await browser.click(f'{CARD} button[data-action="park"]')
    await browser.until(f"document.querySelector('{CARD} [data-answer]')?.textContent"
                        "?.startsWith('park: done')", within=60)  # fmt: skip
    await browser.until(enabled_are("start", "stop"))  # at rest: nothing to park
    await browser.click(f'{CARD} button[data-action="start"]')
    await browser.until(state_is("ready"), within=60)
    assert con.gw.gateway.fleet.lifecycle.lives["my-model"].state == "ready"
    # the engine's log, on its button
    await browser.click(f'{CARD} button[data-log="0"]')
    text = await browser.until(f"document.querySelector('{CARD} pre.log')?.textContent")
    assert "fake engine args" in text and "SeCrEt-FlAg-99" not in text


async def test_an_event_shows_without_a_reload(
    browser: Browser,
    launched_console: Console,  # noqa: F811
) -> None:
    con = launched_console
    await browser.goto(f"{con.url}/#key={con.gw.key}")
    await browser.until("document.querySelector('#eventstate')?.textContent === 'live'")
    await browser.js("window.stayed = true")  # gone if the page reloads
    async with con.gw.client() as c:
        r = await c.post("/v1/chat/completions", json=chat(), headers={"X-Request-Id": "mine-5"})
    assert r.status_code == 200
    rid = r.headers["x-capyctl-request-id"]
    shown = await browser.until(
        "document.querySelector('#events li[data-event=\"router_selection\"]')?.textContent"
    )
    assert rid in shown and "mine-5" not in await browser.js("document.body.textContent")
    assert await browser.js("window.stayed") is True
    # the deployment it concerns is refreshed too: ready, and the request counted
    await browser.until(state_is("ready"))
    await browser.until(f"!!document.querySelector('{CARD} [data-figures]')")


async def test_the_events_panel_opens_on_the_recent_events(
    browser: Browser,
    launched_console: Console,  # noqa: F811
) -> None:
    """What happened before the page was opened (the engine's start) shows at once, and once:
    nothing happens after the page opens."""
    con = launched_console
    async with con.gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    await browser.goto(f"{con.url}/#key={con.gw.key}")
    await browser.until("document.querySelector('#eventstate')?.textContent === 'live'")
    shown = await browser.until(
        "[...document.querySelectorAll('#events li[data-event=\"lifecycle\"]')]"
        ".map((li) => li.textContent)"
    )
    assert len(shown) == 2, shown  # newest first: started, then ready
    assert "from=starting" in shown[0] and "to=ready" in shown[0]
    assert "from=stopped" in shown[1] and "reason=a request is waiting" in shown[1]


def duration(seconds: float) -> str:
    """As the page writes a time (console.js ``duration``)."""
    ms = seconds * 1000
    if ms < 10:
        return f"{ms:.1f} ms"
    return f"{int(ms + 0.5)} ms" if ms < 10000 else f"{seconds:.1f} s"


async def test_ttft_is_the_answers_figure_and_the_start_wait_shows_apart(
    browser: Browser,
    launched_console: Console,  # noqa: F811
) -> None:
    con = launched_console
    async with con.gw.client() as c:  # the first waits for the engine's start
        for _ in range(3):
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    async with con.client() as m:
        totals = (await m.get("/management/v1/recent")).json()["totals"]["my-model"]
    await browser.goto(f"{con.url}/#key={con.gw.key}")
    figure = f"document.querySelector('{CARD} [data-figure=\"%s\"] .value')?.textContent"
    assert await browser.until(figure % "ttft") == duration(totals["ttft_s"])
    assert await browser.until(figure % "wake") == f"{duration(totals['wake_s'])} (1)"
    assert totals["wake_s"] > totals["ttft_s"]


async def test_the_memory_budget_shows_each_pool_and_each_deployments_share(
    browser: Browser,
    console_of: Callable[[Gw], Awaitable[Console]],  # noqa: F811
    make_gateway: MakeGateway,
) -> None:
    memory = {"ready": "1GiB", "parked": 0}
    config = {
        "resources": {"memory_budget": "1536MiB"},
        "deployments": [
            launched("a", served="model-a", memory=memory),
            launched("b", served="model-b", memory={"ready": "512MiB"}),
        ],
    }
    gw = await make_gateway(config)
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat("a"))).status_code == 200
    con = await console_of(gw)
    await browser.goto(f"{con.url}/#key={con.gw.key}")
    pool = '[data-pool="this machine"]'
    held = await browser.until(f"document.querySelector('{pool} [data-held]')?.textContent")
    assert held == "1 GiB of 1.5 GiB"
    shares = await browser.js(f"document.querySelector('{pool} [data-shares]').textContent")
    assert shares == "a 1 GiB · b 0 B"
    # the page writes sizes as the CLI does (render.size), to the digit
    for n in (0, 1023, 1024, 1536, 2**30, 9 * 2**27, 2**30 + 5 * 2**20, 10**9, 5 * 2**40 + 1):
        assert await browser.js(f"size({n})") == size(n), n


async def test_each_card_says_why_its_recent_switches_happened(
    browser: Browser,
    console_of: Callable[[Gw], Awaitable[Console]],  # noqa: F811
    make_gateway: MakeGateway,
) -> None:
    """Room for one: a request for b switches a out. The card of a says so, with its start
    before the page was opened (the recent events) and the switch after (live)."""
    memory = {"ready": "1GiB", "parked": 0}
    config = {
        "resources": {"memory_budget": "1GiB"},
        "deployments": [
            launched(n, served=f"model-{n}", memory=memory, lifecycle={"park": "sleep"})
            for n in ("a", "b")
        ],
    }
    gw = await make_gateway(config)
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat("a"))).status_code == 200
    con = await console_of(gw)
    await browser.goto(f"{con.url}/#key={con.gw.key}")
    rows = "[...document.querySelectorAll('[data-changes=\"a\"] > div')]"
    changes = f"{rows}.map((d) => d.textContent.slice(d.firstChild.textContent.length + 1))"
    first = await browser.until(f"{changes}.length === 2 && {changes}")  # newest first
    assert first[0].startswith("starting → ready: answered on port ")
    assert first[1] == "stopped → starting: a request is waiting"
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat("b"))).status_code == 200
    shown = await browser.until(f"{changes}.length === 4 && {changes}")
    why = "switched out for deployment b (the memory budget)"
    assert shown[:2] == [f"parking → parked: {why}", f"ready → parking: {why}"]


async def test_the_pool_over_time_shows_one_deployment_giving_way_to_another(
    browser: Browser,
    console_of: Callable[[Gw], Awaitable[Console]],  # noqa: F811
    make_gateway: MakeGateway,
) -> None:
    """Room for one: a serves, then a request for b switches a out. The pool's strip shows a's
    band first and b's last, up to now (the strip's right edge), each the budget's height."""
    memory = {"ready": "1GiB", "parked": 0}
    config = {
        "resources": {"memory_budget": "1GiB"},
        "deployments": [
            launched(n, served=f"model-{n}", memory=memory, lifecycle={"park": "sleep"})
            for n in ("a", "b")
        ],
    }
    gw = await make_gateway(config)
    async with gw.client() as c:
        for name in ("a", "b"):
            assert (await c.post("/v1/chat/completions", json=chat(name))).status_code == 200
    con = await console_of(gw)
    await browser.goto(f"{con.url}/#key={con.gw.key}")
    rects = "[...document.querySelectorAll('[data-history=\"this machine\"] rect')]"
    bands = f"{rects}.map((r) => ['x', 'width', 'height'].map((k) => +r.getAttribute(k)))"
    names = f"{rects}.map((r) => r.getAttribute('data-deployment'))"
    shown = await browser.until(f"{names}.length >= 2 && {names}")
    assert shown[0] == "a" and shown[-1] == "b", shown
    x, width, height = (await browser.js(bands))[-1]
    assert x + width == pytest.approx(600) and height == pytest.approx(24)


async def test_a_wrong_key_is_told_plainly_and_another_can_be_entered(
    browser: Browser,
    launched_console: Console,  # noqa: F811
) -> None:
    con = launched_console
    await browser.goto(f"{con.url}/#key=not-the-key")
    message = await browser.until("document.querySelector('#keymsg')?.textContent")
    assert "refused this key (401" in message
    assert await browser.js("document.querySelector('#keyform').hidden") is False
    assert await browser.js("sessionStorage.getItem('capyctl-key')") is None
    await browser.js(
        f"document.querySelector('#key').value = {json.dumps(con.gw.key)};"
        "document.querySelector('#keyf').requestSubmit()"
    )
    await browser.until(f"!!document.querySelector('{CARD}')")
    assert await browser.js("document.querySelector('#keymsg').textContent") == ""


async def test_a_ticket_opens_the_console_once(
    browser: Browser,
    launched_console: Console,  # noqa: F811
) -> None:
    """The address `capyctl console` printed, opened again (from the browser's history, say),
    opens nothing: the page says why and asks for the key."""
    con = launched_console
    async with con.client() as c:
        ticket = (await c.post("/management/v1/console/tickets")).json()["ticket"]
    await browser.goto(f"{con.url}/#ticket={ticket}")
    await browser.until(f"!!document.querySelector('{CARD}')")
    await browser.js("sessionStorage.clear()")
    await browser.goto("about:blank")  # a new load, not a jump within the page
    await browser.goto(f"{con.url}/#ticket={ticket}")
    message = await browser.until("document.querySelector('#keymsg')?.textContent")
    assert "used already or has expired" in message
    assert await browser.js("document.querySelector('#keyform').hidden") is False
    assert await browser.js("sessionStorage.getItem('capyctl-key')") is None
    assert await browser.js("location.hash") == ""


async def test_a_pods_row_shows_its_node_and_why_it_waits_and_its_log_comes_from_the_api(
    browser: Browser,
    console_of: Callable[[Gw], Awaitable[Console]],  # noqa: F811
    cluster: PodCluster,  # noqa: F811
    make_gateway: MakeGateway,
) -> None:
    running = pod_deployment()
    inst = running["instances"][0]  # the engine prints its key (as its own key: masked)
    inst["launch"]["command"] += ["--echo-env", "SHOWN"]
    inst["launch"]["env"] = {"SHOWN": "SeCrEt-FlAg-99"}
    inst["api_key_env"] = "ENGINE_KEY"
    waiting = pod_deployment("big")
    waiting["instances"][0]["pod"]["resources"] = {"limits": {"nvidia.com/gpu": 3}}
    gw = await make_gateway(
        config(running, waiting), env=cluster.env | {"ENGINE_KEY": "SeCrEt-FlAg-99"}
    )
    async with gw.client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
    gw.gateway.fleet.lifecycle.want("big")  # its pod waits for a node that has 3 GPUs
    con = await console_of(gw)
    async with con.client() as c:
        ticket = (await c.post("/management/v1/console/tickets")).json()["ticket"]
    await browser.goto(f"{con.url}/#ticket={ticket}")
    (pod,) = cluster.pods("my-model")
    row = f'{CARD} [data-pod-of="0"]'
    text = await browser.until(f"document.querySelector({json.dumps(row)})?.textContent")
    assert text == f"pod {NS}/{pod['metadata']['name']} on node gpu-1: Running"
    big = '[data-deployment="big"] [data-pod-of="0"]'
    text = await browser.until(
        f"document.querySelector({json.dumps(big)})?.textContent?.includes('it waits')"
        f" && document.querySelector({json.dumps(big)}).textContent"
    )
    assert "Insufficient nvidia.com/gpu" in text
    await browser.click(f'{CARD} button[data-log="0"]')
    text = await browser.until(f"document.querySelector('{CARD} pre.log')?.textContent")
    assert "fake engine: loaded ***" in text and "SeCrEt-FlAg-99" not in text
