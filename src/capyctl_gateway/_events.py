"""The live event stream: every gateway event (`_log.event`) handed to the few subscribers of
``GET /management/v1/events``, bounded on every side; and the last `RECENT_EVENTS` of them
that are not about one request, which a new stream may begin with (the console opens on them).

While nobody subscribes, an event about one request (a router line: it names a
``capyctl_request_id``) pays two tests and nothing else: a second's traffic would otherwise
wash every other event out of the recent ones, and the log keeps it. Every other event (a
transition, a dispatch change, a host's session) is encoded once and kept. A subscriber gets
each event as one encoded JSON object in a queue of its own, at most `QUEUE_EVENTS` long:
publishing never waits, and a subscriber whose queue is full (a reader slower than the
gateway's events) is dropped there and then, its stream ended.
At most `MAX_SUBSCRIBERS` subscribe at once. The caller's own request ID never enters an event
here (`WITHHELD`), nor does a key: events carry none.

Imports nothing of the gateway but `_loop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

import orjson

from ._loop import running_loop

__all__ = [
    "BUS",
    "MAX_SUBSCRIBERS",
    "PER_REQUEST",
    "QUEUE_EVENTS",
    "RECENT_EVENTS",
    "WITHHELD",
    "EventBus",
    "Subscription",
]

MAX_SUBSCRIBERS = 8
"""Streams open at once; one more is refused (503 ``too_many_subscribers``)."""
QUEUE_EVENTS = 1000
"""Events waiting for one subscriber; one more drops it."""
RECENT_EVENTS = 50
"""Events not about one request kept for a stream that asks to begin with them."""
WITHHELD = frozenset({"caller_request_id"})
"""Event fields the stream never carries: the caller's own ID stays in the log."""
PER_REQUEST = "capyctl_request_id"
"""The field that marks an event about one request: never kept among the recent ones."""


class Subscription:
    """One subscriber's queue of encoded events (JSON objects), and whether it was dropped."""

    __slots__ = ("_items", "_cap", "_wake", "_loop", "ended")

    def __init__(self, cap: int, loop: asyncio.AbstractEventLoop) -> None:
        self._items: deque[bytes] = deque()
        self._cap = cap
        self._wake = asyncio.Event()
        self._loop = loop
        self.ended: str | None = None
        """Why its stream ends (its queue overflowed and the bus let it go, or the listener
        closes); None while it lasts."""

    def put(self, item: bytes) -> bool:
        """Queue ``item``; False (and nothing queued) when the queue is full."""
        if len(self._items) >= self._cap:
            return False
        self._items.append(item)
        self._notify()
        return True

    def fill(self, items: deque[bytes]) -> None:
        """Queue ``items`` (fewer than the cap: the recent events) before anything else."""
        self._items.extend(list(items)[-self._cap :])
        self._notify()

    def _notify(self) -> None:
        try:
            here = running_loop() is self._loop
        except RuntimeError:
            here = False
        if here:
            self._wake.set()
        else:  # an event logged from another thread (its loop closed: nobody reads it)
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._wake.set)

    def end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why
        self._notify()

    async def take(self, within: float) -> list[bytes]:
        """The events queued, waiting up to ``within`` seconds for one (none: an empty list)."""
        if not self._items and self.ended is None:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), within)
            except TimeoutError:
                return []
        out = list(self._items)
        self._items.clear()
        return out


class EventBus:
    """Who listens to the gateway's events, and the hand-over to each."""

    __slots__ = ("subscribers", "max_subscribers", "queue_events", "recent")

    def __init__(
        self,
        max_subscribers: int = MAX_SUBSCRIBERS,
        queue_events: int = QUEUE_EVENTS,
        recent_events: int = RECENT_EVENTS,
    ) -> None:
        self.subscribers: tuple[Subscription, ...] = ()
        """Replaced, never changed in place: `publish` walks a tuple nobody else changes."""
        self.max_subscribers = max_subscribers
        self.queue_events = queue_events
        self.recent: deque[bytes] = deque(maxlen=recent_events)
        """The last events not about one request, encoded, oldest first."""

    def subscribe(self, *, recent: bool = False) -> Subscription | None:
        """A new subscription on the running loop, its queue holding the recent events first
        when ``recent`` (so none is missed or seen twice between them and the live ones);
        None when `max_subscribers` are taken."""
        if len(self.subscribers) >= self.max_subscribers:
            return None
        sub = Subscription(self.queue_events, running_loop())
        if recent:
            sub.fill(self.recent)
        self.subscribers = (*self.subscribers, sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self.subscribers = tuple(s for s in self.subscribers if s is not sub)

    def publish(self, name: str, fields: dict[str, Any]) -> None:
        """Hand event ``name`` to every subscriber (its `WITHHELD` fields left out); drop each
        whose queue is full."""
        doc = {"ts": round(time.time(), 3), "event": name}
        doc.update((k, v) for k, v in fields.items() if k not in WITHHELD)
        try:
            item = orjson.dumps(doc, default=str)
        except TypeError:  # a field orjson cannot write at all: the event's name alone
            item = orjson.dumps({"ts": doc["ts"], "event": name})
        if PER_REQUEST not in fields:
            self.recent.append(item)
        for sub in self.subscribers:
            if not sub.put(item):
                sub.end(f"dropped: {self.queue_events} events waited for this reader")
                self.unsubscribe(sub)


BUS = EventBus()
"""The process's bus: `_log.event` publishes to it."""
