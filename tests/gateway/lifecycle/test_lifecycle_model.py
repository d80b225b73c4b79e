"""A model test of the lifecycle: a seeded random schedule of concurrent traffic and operator
commands against three launched deployments under a memory budget that holds two, over real
sockets. It runs twice: on the fake runner (the launchable engine's application in this
process) on the virtual clock (``tests/vclock.py``: every timeout, backoff and the idle clock
at their configured lengths, idle time passing at once), for thousands of steps in seconds;
and on real engine processes (the launchable fake engine under its reaper) on real time, for a
few dozen.

The schedule mixes streamed and whole answers, short and long generations, clients that hang
up before the head or mid-stream, requests that crash their engine, and operator starts, stops
and parks. Checked at every lifecycle transition: the ledger never holds more than the budget,
never two engine processes run for one instance, and never more engines are awake than the
budget holds. Checked at the end: every request got 200 or a documented refusal; a request was
cut only where an operator's stop or a crash overlapped it (never by a switch or an idle park);
``status`` and ``list`` match the processes that really run; every cut request settles once
its engine stops.

CI runs a fixed seed and a bounded number of steps (`STEPS`); ``CAPYCTL_MODEL_SEED`` and
``CAPYCTL_MODEL_STEPS`` run others (the seed is printed, so a failure can be replayed). The long
run: ``CAPYCTL_MODEL_STEPS=20000 .venv/bin/pytest tests/gateway/lifecycle/test_lifecycle_model.py -k virtual``
(docs/reliability.md has its figures).
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest

from capyctl_gateway._clock import stamp
from capyctl_gateway._lifecycle.operator import deployments_list
from capyctl_gateway._lifecycle.rest import quiesce
from capyctl_gateway._management.status import deployment_status
from tests.gateway.conftest import WORKERS, Gw
from tests.gateway.fake_runner import FakeEngines
from tests.gateway.lifecycle.test_lifecycle import launched, management
from tests.gateway.lifecycle.test_lifecycle_races import running, said, served
from tests.vclock import VirtualLoop

pytestmark = pytest.mark.anyio
workers = WORKERS  # one process, and two workers behind their authority
MakeGateway = Callable[..., Awaitable[Gw]]
SEED = int(os.environ.get("CAPYCTL_MODEL_SEED", "20261202"))
STEPS = {"process": 36, "virtual": 2000}
"""Steps per run in CI, by runner (``CAPYCTL_MODEL_STEPS`` sets both)."""
PACE = {"process": 1.0, "virtual": 1.0}
"""The schedule's gaps and generation times (seconds). On the virtual clock
(``tests/vclock.py``) they and every timeout keep their length, and idle time passes in no
time."""
NAMES = ("a", "b", "c")
GiB = 2**30
BUDGET = 2 * GiB
DOCUMENTED = {
    409: {"deployment_stopped"},
    429: {"queue_full"},
    500: {"activation_failed"},
    502: {"engine_error"},
    503: {"unavailable"},
}


@dataclass
class Ask:
    """One chat request of the schedule and what became of it."""

    dep: str
    take: float
    stream: bool
    hang: str | None
    """None, ``head`` (hang up before the answer's head) or ``mid`` (after the first chunk)."""
    crash: bool = False
    began: float = 0.0
    ended: float = 0.0
    status: int | None = None
    code: str | None = None
    complete: bool = False
    """The whole answer: [DONE] on a stream, a JSON answer with a choice otherwise."""


@dataclass
class Command:
    verb: str
    dep: str
    began: float = 0.0
    ended: float = 0.0
    status: int | None = None
    code: str | None = None


@dataclass
class Run:
    asks: list[Ask] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)
    """Invariants found broken at a transition."""
    failed: list[tuple[str, float]] = field(default_factory=list)
    """When the gateway saw each crashed engine gone (its instance turned failed)."""


@pytest.fixture(params=["process", "virtual"])
def fakes(request: pytest.FixtureRequest) -> FakeEngines | None:
    """Real engine processes on real time, or the fake runner's on the virtual clock."""
    return None if request.param == "process" else FakeEngines()


def schedule(rng: random.Random, steps_n: int, pace: float) -> list[tuple[float, Ask | Command]]:
    steps: list[tuple[float, Ask | Command]] = []
    for _ in range(steps_n):
        gap = rng.uniform(0.0, 0.35) * pace
        dep = rng.choice(NAMES)
        roll = rng.random()
        if roll < 0.72:
            hang = rng.choices([None, "head", "mid"], weights=[6, 1, 1])[0]
            take = rng.choice([0.0, 0.0, 0.3, 1.0, 2.5]) * pace
            steps.append((gap, Ask(dep, take, rng.random() < 0.6, hang)))
        elif roll < 0.77:
            steps.append((gap, Ask(dep, 0.0, True, None, crash=True)))
        else:
            steps.append((gap, Command(rng.choice(["start", "stop", "park", "start"]), dep)))
    return steps


async def ask(c: httpx.AsyncClient, a: Ask, body: dict[str, Any] | None = None) -> None:
    """Send ``a`` (``body``: what to send instead of the plain one) and record its answer."""
    if body is None:
        body = said("crash" if a.crash else f"take:{a.take}", a.dep)
    if a.stream:
        body["stream"] = True
    a.began = stamp()
    try:
        if a.hang == "head":
            with anyio.move_on_after(0.05):
                await c.post("/v1/chat/completions", json=body)
            return
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            a.status = r.status_code
            text = ""
            async for line in r.aiter_lines():
                text += line + "\n"
                if a.hang == "mid" and line.startswith("data:"):
                    return
        if a.status != 200:
            a.code = httpx.Response(a.status, content=text).json().get("code")
        elif a.stream:
            a.complete = text.rstrip().endswith("data: [DONE]") and '"error"' not in text
        else:
            a.complete = bool(httpx.Response(200, content=text).json().get("choices"))
    except httpx.HTTPError:
        a.complete = False  # a cut whole answer or stream
    finally:
        a.ended = stamp()


async def command(m: httpx.AsyncClient, base: str, cmd: Command) -> None:
    cmd.began = stamp()
    try:
        r = await m.post(f"{base}/deployments/{cmd.dep}/{cmd.verb}")
        cmd.status = r.status_code
        cmd.code = r.json().get("code") if r.status_code != 200 else None
    finally:
        cmd.ended = stamp()


def watch(gw: Gw, run: Run) -> None:
    """Check the invariants at every lifecycle transition."""
    lifecycle = gw.gateway.fleet.lifecycle

    asleep: set[str] = set()
    """Parked engines, and parked ones on their way to a stop: their process holds no
    ready memory."""

    def check(lc: Any) -> None:
        name, state = lc.inst.deployment, lc.state.value
        if state == "failed":
            run.failed.append((name, stamp()))
        if state == "parked":
            asleep.add(name)
        elif state != "stopping":
            asleep.discard(name)
        held = lifecycle.budget.held()
        if held > BUDGET:
            states = {n: life.state for n, life in lifecycle.lives.items()}
            run.broken.append(f"{held} bytes held against {BUDGET} at {lc.inst.where}: {states}")
        awake = 0
        for name in NAMES:
            pids = running(gw, served(name))
            if len(pids) > 1:
                run.broken.append(f"two engines for {name}: {pids}")
            if pids and name not in asleep:
                awake += 1
        if awake > BUDGET // GiB:
            seen = {n: (life.state, running(gw, served(n))) for n, life in lifecycle.lives.items()}
            run.broken.append(
                f"{awake} engines awake under a budget for {BUDGET // GiB} at "
                f"{lc.inst.where} -> {lc.state.value}: {seen}"
            )

    lifecycle.engines.observers.append(check)


def overlapped(a: Ask, run: Run) -> bool:
    """Whether an operator's stop or an engine crash on ``a``'s deployment overlapped it (a
    crash until the gateway saw the engine gone: a request offered to it in between, up to
    the second the gateway takes to look, gets 502 ``engine_error``)."""
    faults = [(c.began, c.ended) for c in run.commands if c.dep == a.dep and c.verb == "stop"]
    for x in run.asks:  # a crash, until the gateway saw the engine gone
        if x.dep == a.dep and x.crash:
            seen = [t for dep, t in run.failed if dep == a.dep and t >= x.began]
            faults.append((x.began, min(seen, default=x.ended)))
    return any(start <= a.ended and end >= a.began for start, end in faults)


@pytest.fixture
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    """The virtual runner's tests run on the virtual clock; the others on real time."""
    if getattr(request.node, "callspec", None) and request.node.callspec.params.get("fakes") == (
        "virtual"
    ):
        return ("asyncio", {"loop_factory": VirtualLoop})
    return "asyncio"


async def test_the_lifecycle_under_a_random_schedule_loses_no_request(
    make_gateway: MakeGateway, fakes: FakeEngines | None, request: pytest.FixtureRequest
) -> None:
    kind = str(request.node.callspec.params["fakes"])
    steps = int(os.environ.get("CAPYCTL_MODEL_STEPS", STEPS[kind]))
    print(f"lifecycle model: seed {SEED}, {steps} steps on the {kind} runner")  # noqa: T201
    memory = {"ready": "1GiB", "parked": 0}
    deps = [
        launched("a", served=served("a"), memory=memory,
                 lifecycle={"drain_timeout": "2s", "come_back": True}),
        launched("b", served=served("b"), memory=memory,
                 lifecycle={"drain_timeout": "2s", "ready_idle_timeout": "1s"}),
        launched("c", served=served("c"), memory=memory,
                 lifecycle={"drain_timeout": "2s", "park": "sleep"}),
    ]  # fmt: skip
    config = {
        "resources": {"memory_budget": "2GiB"},
        "queue": {"request_deadline": "20s"},
        "deployments": deps,
    }
    gw = await make_gateway(config)
    run = Run()
    watch(gw, run)
    runner, base = await management(gw)
    auth = {"Authorization": f"Bearer {gw.key}"}
    rng = random.Random(SEED)
    try:
        await play(gw, base, schedule(rng, steps, PACE[kind]), run)
        lifecycle = gw.gateway.fleet.lifecycle
        with anyio.fail_after(30):
            for life in lifecycle.lives.values():
                await quiesce(life)
        assert run.broken == []
        print(summary(run))  # noqa: T201
        judge(run)
        await until_agreed(gw)
        # Every cut request settles once its engine stops.
        async with httpx.AsyncClient(headers=auth, timeout=60) as m:
            for name in NAMES:
                assert (await m.post(f"{base}/deployments/{name}/stop")).status_code == 200
        for name in NAMES:
            assert running(gw, served(name)) == []
            assert gw.gateway.fleet.settlement.ledgers[f"{name}/0"].cut == []
        assert lifecycle.budget.held() == 0
    finally:
        await runner.cleanup()
    assert run.broken == []


async def play(
    gw: Gw,
    base: str,
    steps: list[tuple[float, Ask | Command]],
    run: Run,
    send: Callable[[httpx.AsyncClient, Any], Coroutine[Any, Any, None]] = ask,
) -> None:
    """Play ``steps`` at their own pace, each at once: requests through ``send``, commands to
    the management API at ``base``; ``run`` records them. Returns once every one has ended."""
    auth = {"Authorization": f"Bearer {gw.key}"}
    async with (
        gw.client(timeout=60) as c,
        httpx.AsyncClient(headers=auth, timeout=60) as m,
        anyio.create_task_group() as tg,
    ):
        for gap, step in steps:
            await anyio.sleep(gap)  # the schedule's own pace, not synchronisation
            if isinstance(step, Ask):
                run.asks.append(step)
                tg.start_soon(send, c, step)
            else:
                run.commands.append(step)
                tg.start_soon(command, m, base, step)


def judge(run: Run) -> None:
    """Every request got 200 or a documented refusal; only a stop or a crash cut one."""
    for a in run.asks:
        if a.hang is not None:
            continue
        if a.status is not None and a.status != 200:
            assert a.code in DOCUMENTED.get(a.status, set()), (a, "an undocumented answer")
            if a.status in (500, 502) and not a.crash:
                assert overlapped(a, run), (a, "an engine failure no crash explains")
            continue
        if not a.complete and not a.crash:
            assert overlapped(a, run), (a, "cut by neither a stop nor a crash")
    for cmd in run.commands:
        # A park whose drain fails is refused; a start that finds no room (every other
        # deployment busy or its switch failed) is a retryable 503, as for a request; a start
        # that an operator's stop overtook is abandoned, 409 deployment_stopped.
        if (cmd.verb, cmd.status, cmd.code) == ("start", 409, "deployment_stopped"):
            assert any(
                o.verb == "stop" and o.dep == cmd.dep and cmd.began <= o.began <= cmd.ended
                for o in run.commands
            ), (cmd, "a start refused with no stop after it")
            continue
        allowed = {200: None, 409: "park_refused", 503: "unavailable"}
        assert cmd.status in allowed and cmd.code == allowed[cmd.status], cmd


async def until_agreed(gw: Gw, within: float = 10) -> None:
    """Wait for ``agree`` to hold: an engine that a crash request killed a moment ago is seen
    gone within the reaper's look and the exit watch (a transition), never later."""
    changed = asyncio.Event()
    gw.gateway.fleet.lifecycle.engines.observers.append(lambda lc: changed.set())
    with anyio.fail_after(within):
        while True:
            try:
                agree(gw)
                return
            except AssertionError:
                changed.clear()
                await changed.wait()


def agree(gw: Gw) -> None:
    """``status`` and ``list`` say what really runs."""
    fleet = gw.gateway.fleet
    listing = {
        row["name"]: row
        for row in deployments_list(fleet.lifecycle, fleet.routes, BUDGET)["deployments"]
    }
    for name in NAMES:
        pids = running(gw, served(name))
        doc = deployment_status(fleet, name)
        assert doc is not None
        state = fleet.lifecycle.lives[name].state
        seen = doc["instances"][0]
        assert (state in ("ready", "parked")) == bool(pids), (name, state, pids, repr(seen))
        if pids:
            assert doc["instances"][0]["process"]["pid"] in pids or pids[0] in _children(
                doc["instances"][0]["process"]["pid"]
            )
        row = listing[name]
        assert row["ready"] == (1 if state == "ready" else 0), (name, row)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def summary(run: Run) -> str:
    seen: dict[str, int] = {}
    for a in run.asks:
        key = "hung up" if a.hang else f"{a.status} {a.code or ('whole' if a.complete else 'cut')}"
        seen[key] = seen.get(key, 0) + 1
    for cmd in run.commands:
        key = f"{cmd.verb} {cmd.status}"
        seen[key] = seen.get(key, 0) + 1
    return ", ".join(f"{k}: {n}" for k, n in sorted(seen.items()))
