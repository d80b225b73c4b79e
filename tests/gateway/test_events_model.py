"""The event bus under any interleaving of subscribers coming and going, events published and
slow readers: a stateful property test against a plain model. Invariants after every step: at
most `max_subscribers` subscribe; no reader ever holds more than `queue_events` events; a reader
that fell behind is dropped (its stream told why) and gets nothing more; every other reader gets
every event published since it subscribed, in order, without the caller's own request ID."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from capyctl_gateway._events import EventBus, Subscription

MAX_SUBSCRIBERS, QUEUE_EVENTS = 3, 4


class BusModel(RuleBasedStateMachine):
    readers = Bundle("readers")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.bus: EventBus = self.run(self._make())
        self.queued: dict[int, list[int]] = {}  # id(sub) -> the event numbers not yet taken
        self.dropped: set[int] = set()
        self.number = 0

    async def _make(self) -> EventBus:
        return EventBus(max_subscribers=MAX_SUBSCRIBERS, queue_events=QUEUE_EVENTS)

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.loop.close()

    @rule(target=readers)
    def subscribe(self) -> Subscription | None:
        async def go() -> Subscription | None:
            return self.bus.subscribe()

        sub: Subscription | None = self.run(go())
        live = len(self.queued)
        if live >= MAX_SUBSCRIBERS:
            assert sub is None
            return None
        assert sub is not None
        self.queued[id(sub)] = []
        return sub

    @rule(caller=st.booleans(), size=st.integers(0, 3))
    def publish(self, caller: bool, size: int) -> None:
        self.number += 1
        fields: dict[str, Any] = {"n": self.number, "pad": "x" * size}
        if caller:
            fields["caller_request_id"] = "theirs-1"
        self.bus.publish("router_selection", fields)
        for key, queue in list(self.queued.items()):
            if len(queue) >= QUEUE_EVENTS:  # this reader fell behind: dropped
                del self.queued[key]
                self.dropped.add(key)
            else:
                queue.append(self.number)

    @rule(sub=readers)
    def take(self, sub: Subscription | None) -> None:
        if sub is None:
            return
        got = self.run(sub.take(0.0))
        if id(sub) in self.dropped:
            assert sub.ended is not None and "dropped" in sub.ended
            return
        if id(sub) not in self.queued:
            return  # it left
        events = [orjson.loads(item) for item in got]
        assert [e["n"] for e in events] == self.queued[id(sub)]
        assert all("caller_request_id" not in e and e["event"] == "router_selection"
                   for e in events)  # fmt: skip
        self.queued[id(sub)] = []

    @rule(sub=consumes(readers))
    def leave(self, sub: Subscription | None) -> None:
        if sub is None:
            return
        self.bus.unsubscribe(sub)
        self.queued.pop(id(sub), None)

    @invariant()
    def bounded(self) -> None:
        assert len(self.bus.subscribers) == len(self.queued) <= MAX_SUBSCRIBERS
        assert {id(s) for s in self.bus.subscribers} == set(self.queued)
        assert all(len(q) <= QUEUE_EVENTS for q in self.queued.values())
        assert not self.dropped & set(self.queued)


BusModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_the_event_bus_holds_its_bounds_under_any_interleaving = BusModel.TestCase
