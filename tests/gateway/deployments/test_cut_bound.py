"""The bound on the cut requests one instance counts, and the fixed reasons they settle by.

An engine someone else runs (``url:``) may never restart, so every hang-up before its first
token stays counted: without a bound its ledger, `status`, the store and the metrics grew
for as long as the gateway ran."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import anyio
import pytest

from capyctl_gateway._deployments import settle
from capyctl_gateway._deployments.settle import (
    MAX_CUT,
    OVER_THE_BOUND,
    CutRequest,
    Settlement,
    SettleRule,
)
from capyctl_gateway._management.status import deployment_status
from capyctl_gateway._store import Store
from tests.eventually import eventually
from tests.gateway.conftest import Gw, deployments
from tests.gateway.deployments.test_cancel import give_up
from tests.gateway.fake_engine import FakeEngine, Hold
from tests.gateway.management.test_metrics import samples, scrape

pytestmark = pytest.mark.anyio
MakeGateway = Callable[..., Awaitable[Gw]]


def test_an_instance_counts_at_most_max_cut_and_lets_the_oldest_go(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    settled: list[tuple[list[CutRequest], str]] = []

    def on_settled(key: str, cuts: list[CutRequest], why: str) -> None:
        store.settled(key, cuts)
        settled.append((cuts, why))

    settlement = Settlement(
        lambda: 100.0, poll=lambda key, ms: None, on_cut=store.add_cut, on_settled=on_settled
    )
    book = settlement.ledger("e/0")
    for n in range(MAX_CUT + 5):
        settlement.cut(book, f"r{n}", answered=False, reason="hang_up")
    assert len(book.cut) == MAX_CUT
    assert [c.request_id for c in book.cut] == [f"r{n}" for n in range(5, MAX_CUT + 5)]
    assert [(len(cuts), why) for cuts, why in settled] == [(1, OVER_THE_BOUND)] * 5
    assert [c.request_id for cuts, _ in settled for c in cuts] == [f"r{n}" for n in range(5)]
    assert len(store.cuts()["e/0"]) == MAX_CUT  # what outlives the process is bounded too
    # What a previous run left is bounded on the way in as well.
    again = Settlement(lambda: 100.0, poll=lambda key, ms: None)
    restored = again.ledger("e/0")
    again.restore(
        restored, [*store.cuts()["e/0"], CutRequest("extra", 101.0, SettleRule.AT_RESTART, "x")]
    )
    assert len(restored.cut) == MAX_CUT and restored.cut[-1].request_id == "extra"
    assert restored.cut[0].request_id == "r6"
    store.close()


async def test_hang_ups_past_the_bound_on_a_url_engine(
    engine: FakeEngine, make_gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real hang-ups before the first token on an engine at a ``url``: the bound (made 2 here)
    keeps the newest, and the one let go is counted under its fixed reason in the metrics."""
    monkeypatch.setattr(settle, "MAX_CUT", 2)
    gw = await make_gateway({"deployments": [deployments(engine.url)]})
    engine.script = [Hold()]
    book = gw.gateway.fleet.settlement.ledgers["my-model/0"]
    for n in range(3):
        engine.arrived.clear()
        await give_up(gw, engine)
        want = min(n + 1, 2)
        await eventually(lambda: len(book.cut) == want and book.running == 0)  # noqa: B023
    assert [c.rule for c in book.cut] == [SettleRule.AT_RESTART] * 2
    let_go = [s for s in gw.gateway.fleet.settlement.recent if s.why == OVER_THE_BOUND]
    assert len(let_go) == 1 and let_go[0].cut.request_id not in {c.request_id for c in book.cut}
    got = samples((await scrape(gw)).text)
    key = (("deployment", "my-model"), ("instance", "0"))
    assert got[("capyctl_cut_requests", (*key, ("settles", "at_restart")))] == 2
    assert got[("capyctl_cut_settled_total", (*key[:1], ("how", OVER_THE_BOUND), key[1]))] == 1
    status = deployment_status(gw.gateway.fleet, "my-model")
    assert status is not None
    (inst,) = status["instances"]
    assert len(inst["cancelled"]) == 2


async def test_many_hang_ups_at_once_past_the_bound_lose_none(
    engine: FakeEngine, make_gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twelve clients at once, each hanging up before its first token, beside others that
    are answered whole, with a bound of 3: every cut is either still counted or let go under
    the bound's reason (none lost, none counted twice), and nothing stays running."""
    monkeypatch.setattr(settle, "MAX_CUT", 3)
    gw = await make_gateway({"deployments": [deployments(engine.url)]})
    settlement = gw.gateway.fleet.settlement
    book = settlement.ledgers["my-model/0"]
    engine.script = [Hold()]
    body = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}]}
    async with gw.client() as c, anyio.create_task_group() as tg:
        for _ in range(12):
            tg.start_soon(partial(c.post, "/v1/chat/completions", json=body))
        await eventually(lambda: len(engine.received) == 12)
        tg.cancel_scope.cancel()  # all twelve hang up, none answered
    await eventually(lambda: book.running == 0 and settlement.settled == 9)
    let_go = [s.cut.request_id for s in settlement.recent if s.why == OVER_THE_BOUND]
    counted = [c.request_id for c in book.cut]
    assert len(counted) == 3 and len(let_go) == 9
    assert len(set(counted) | set(let_go)) == 12  # each cut request is in exactly one place
    assert max(s.cut.cut_at for s in settlement.recent) <= min(c.cut_at for c in book.cut)
