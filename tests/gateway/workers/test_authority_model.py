"""The authority under any interleaving of its workers' words: a stateful property test that
speaks the line's protocol from two workers' sides (real Unix socket lines) to a real
authority over a real fleet, against a plain model of one FIFO queue with a running bound.

Rules: a worker asks (``ADMIT``); a worker ends an offered request completed, cut after it was
sent, or not taken by the engine (``END``, ``NEXT``); a client goes (``GONE``) while waiting,
with its offer on the way, as it asks (ADMIT and GONE in one write) or as the engine refused
it (NEXT and GONE in one write); a worker's line dies and a new one takes its place. Checked
after every step: offers go out in the order the requests asked, over both workers; the
queue's running and waiting counts, the instance's in-flight requests and its ledger are the
model's, and so are the requests the authority holds for its lines; a request past the waiting bound is refused ``queue_full``; nothing of a dead line
stays charged but its cut requests, each until it is settled.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from aiohttp import web
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from canopyx_provider import ProviderOptions
from capyctl_gateway import GATEWAY_KEY, GatewayConfig, GatewayRunner, create_app
from capyctl_gateway._deployments.routes import Route
from capyctl_gateway._workers.authority import Authority
from capyctl_gateway._workers.messages import (
    Admit,
    End,
    Gone,
    Hello,
    Message,
    Next,
    Offer,
    Refused,
)
from capyctl_gateway._workers.wire import Wire
from tests.gateway.conftest import KEY, deployments
from tests.gateway.fake_engine import FakeEngine

RUNNING, WAITING = 2, 3
QUIET = ProviderOptions(poll_interval_ms=600_000, request_timeout_ms=2000, connect_attempts=1)
"""Polled at the start, then only while cut requests wait for their evidence."""


class Worker:
    """A worker's end of one line, as the test speaks it."""

    def __init__(self) -> None:
        self.got: list[Message] = []
        self.wire = Wire(self.got.append, lambda: None)


def _refused(m: Message, gid: int) -> bool:
    return isinstance(m, Refused) and m.gid == gid


class AuthorityModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.gid = 0
        self.waiting: list[tuple[int, int]] = []  # (worker, gid) in the order they asked
        self.running: list[tuple[int, int]] = []  # offered, not ended
        self.cuts = 0
        self.pending: list[tuple[int, Message]] = []
        # The fleet is opened and closed in one task of its own (its task groups require it);
        # each rule runs the loop until its own coroutine is done.
        self.opened = self.loop.create_future()
        self.closing = asyncio.Event()
        self.life = self.loop.create_task(self._live())
        self.run(self.opened)

    async def _live(self) -> None:
        await self._open()
        self.opened.set_result(None)
        await self.closing.wait()
        for w in self.workers:
            w.wire.close()
        await self.gateway.cleanup()
        await self.engine.cleanup()

    async def _open(self) -> None:
        fake = FakeEngine()
        engine_app = web.Application()
        fake.routes(engine_app)
        self.engine = web.AppRunner(engine_app)
        await self.engine.setup()
        site = web.TCPSite(self.engine, "127.0.0.1", 0)
        await site.start()
        port = self.engine.addresses[0][1]
        config = {
            "queue": {
                "max_running_per_deployment": RUNNING,
                "max_waiting_per_deployment": WAITING,
                "request_deadline": "600s",
            },
            "deployments": [deployments(f"http://127.0.0.1:{port}")],
        }
        app = create_app(GatewayConfig.model_validate(config), KEY, env={}, collector_options=QUIET)
        self.gateway = GatewayRunner(app)
        await self.gateway.setup()
        self.fleet = app[GATEWAY_KEY].fleet
        self.route: Route = self.fleet.routes["my-model"]
        self.authority = Authority(app[GATEWAY_KEY])
        self.workers = [await self._attach(0), await self._attach(1)]

    async def _attach(self, index: int) -> Worker:
        ours, theirs = socket.socketpair()
        await self.authority.attach(ours, index, 2)
        worker = Worker()
        await self.loop.create_unix_connection(lambda: worker.wire, sock=theirs)
        await self._until(lambda: bool(worker.got))
        assert isinstance(worker.got.pop(0), Hello)
        return worker

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def _until(self, check: Any) -> None:
        """Turn the loop until ``check`` holds: each turn lets the lines carry what was sent."""
        for _ in range(10_000):
            if check():
                return
            await asyncio.sleep(0)
        raise AssertionError("the authority never did what the model expects")

    def teardown(self) -> None:
        self.closing.set()
        self.run(self.life)
        self.loop.close()

    def send(self, w: int, message: Message) -> None:
        """Queue ``message`` on worker ``w``'s line: what two calls in a row queue leaves in
        one write, as a worker's words of one loop turn do."""
        self.pending.append((w, message))

    def _flush(self) -> None:
        async def go() -> None:
            for w, message in self.pending:
                self.workers[w].wire.send(message)
            self.pending.clear()

        self.run(go())

    async def _close(self, w: int) -> None:
        self.workers[w].wire.close()

    def _offers(self, w: int) -> list[int]:
        return [m.gid for m in self.workers[w].got if isinstance(m, Offer)]

    def _settle(self) -> None:
        """Send what is queued; then let every word sent reach the authority and its answers come back: running and
        waiting agree with the model, and every request the model runs holds its offer."""

        def agreed() -> bool:
            q = self.route.queue
            offered = all(g in self._offers(w) for w, g in self.running)
            held = sum(len(line.grants) for line in self.authority.lines)
            asked = len(self.running) + len(self.waiting)
            counts = q.running == len(self.running) and q.waiting == len(self.waiting)
            return counts and offered and held == asked

        self._flush()
        self.run(self._until(agreed))

    def _promote(self) -> None:
        while self.waiting and len(self.running) < RUNNING:
            self.running.append(self.waiting.pop(0))

    @rule(w=st.integers(0, 1))
    def admit(self, w: int) -> None:
        gid = self.gid = self.gid + 1
        self.send(w, Admit(gid, "my-model", "chat", f"r{gid}", None, 600.0, None, ()))
        if len(self.running) < RUNNING:
            self.running.append((w, gid))
        elif len(self.waiting) < WAITING:
            self.waiting.append((w, gid))
        else:
            self._flush()
            got = self.workers[w].got
            self.run(self._until(lambda: any(_refused(m, gid) for m in got)))
            refused = next(m for m in got if isinstance(m, Refused) and m.gid == gid)
            assert (refused.status, refused.code) == (429, "queue_full")
        self._settle()

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99), how=st.sampled_from(["completed", "cut", "next", "gone"]))
    def end(self, pick: int, how: str) -> None:
        w, gid = self.running.pop(pick % len(self.running))
        if how == "completed":
            self.send(w, End(gid, True, True, True, None))
        elif how == "cut":
            self.send(w, End(gid, True, False, True, "hang_up"))
            self.cuts += 1
        elif how == "gone":  # its client left as the offer came: nothing was sent
            self.send(w, Gone(gid))
        else:  # never sent, and no other instance: refused
            self.send(w, Next(gid, "connection refused"))
            self._flush()
            self.run(self._until(lambda: any(_refused(m, gid) for m in self._all())))
        self._promote()
        self._settle()

    def _all(self) -> list[Message]:
        return [m for w in self.workers for m in w.got]

    @rule(w=st.integers(0, 1))
    def admit_and_leave_at_once(self, w: int) -> None:
        """ADMIT and GONE in one write: the authority reads both before it starts placing."""
        gid = self.gid = self.gid + 1
        self.send(w, Admit(gid, "my-model", "chat", f"r{gid}", None, 600.0, None, ()))
        self.send(w, Gone(gid))  # the same loop turn: one write
        self._settle()

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def not_taken_then_gone_at_once(self, pick: int) -> None:
        """NEXT and GONE in one write: the engine never got it, and its client left."""
        w, gid = self.running.pop(pick % len(self.running))
        self.send(w, Next(gid, "connection refused"))
        self.send(w, Gone(gid))
        self._promote()
        self._settle()

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 99))
    def leave_the_queue(self, pick: int) -> None:
        w, gid = self.waiting.pop(pick % len(self.waiting))
        self.send(w, Gone(gid))
        self._settle()

    @rule(w=st.integers(0, 1))
    def worker_dies(self, w: int) -> None:
        self.run(self._close(w))
        self.cuts += sum(1 for x, _ in self.running if x == w)  # they may run on the engine
        self.running = [r for r in self.running if r[0] != w]
        self.waiting = [r for r in self.waiting if r[0] != w]
        self.workers[w] = self.run(self._attach(w))
        self._promote()
        self._settle()

    @invariant()
    def the_authority_holds_what_the_model_holds(self) -> None:
        inst = self.route.instances[0]
        assert inst.ledger.running == len(self.running) == len(inst.inflight)
        # Each cut is charged until its evidence settles it (a cut makes the collector poll fast).
        assert len(inst.ledger.cut) + self.fleet.settlement.settled == self.cuts
        assert self.route.queue.running <= RUNNING

    @invariant()
    def offers_went_out_in_the_order_asked(self) -> None:
        """No request still waiting in the model has an offer: a slot that came free went to
        the request that asked first, whichever worker holds it."""
        for w, gid in self.waiting:
            assert gid not in self._offers(w)


AuthorityModel.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_the_authority_keeps_one_queue_for_every_worker = AuthorityModel.TestCase
