"""Admission: at most N requests run per deployment, first come first served within a request's
``priority`` (the lower first, vLLM's convention; 0 unless the request says); a bounded number
wait, per deployment and in total. A waiter that hangs up or misses its deadline leaves at once.

A deployment the gateway launches has a gate on its queue: shut while no instance of it serves
(stopped, parked, starting, or being switched out, parked or stopped), open while one does.
Requests that arrive while it is shut wait in the same FIFO as those waiting for a slot, count
against the same bounds and never hold a running slot, so a drain waits only for requests that
really run. When the gate opens, waiters are let in together, oldest first, up to the running
bound; when the activation they wait for fails, each is given its own error. An engine someone
else runs (``url:``) has no gate: its queue is always open."""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Callable

from .. import _clock
from .._clock import stamp
from .._errors import GatewayError, QueueFullError, UnavailableError
from .._loop import running_loop

__all__ = ["GAP_WEIGHT", "Admission", "BodyBudget", "DeploymentQueue", "Line", "Slot"]

GAP_WEIGHT = 0.3
"""The weight of the newest quiet spell in a queue's moving average (`DeploymentQueue.gap`)."""


class Admission:
    """Shared across deployments: the total number of waiters."""

    def __init__(self, max_waiting_total: int) -> None:
        self.max_waiting_total = max_waiting_total
        self.waiting = 0


class Line:
    """The requests waiting for a slot of one deployment, in the order they are let in: a
    lower ``priority`` first, then first come."""

    __slots__ = ("_arrivals", "entries")

    def __init__(self) -> None:
        self.entries: list[tuple[int, int, float, asyncio.Future[None]]] = []
        """(priority, arrival, since, future), sorted by (priority, arrival)."""
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self.entries)

    def join(self, priority: int) -> tuple[int, int, float, asyncio.Future[None]]:
        """A new waiter's entry, in its place."""
        entry = (priority, next(self._arrivals), stamp(), running_loop().create_future())
        bisect.insort(self.entries, entry, key=_order)
        return entry

    def leave(self, entry: tuple[int, int, float, asyncio.Future[None]]) -> None:
        """``entry`` waits no more (it may have been let in, or failed, already)."""
        at = bisect.bisect_left(self.entries, _order(entry), key=_order)
        if at < len(self.entries) and self.entries[at] is entry:
            del self.entries[at]

    def first(self) -> asyncio.Future[None] | None:
        """Take the first waiter out of the line (None when it is empty)."""
        return self.entries.pop(0)[3] if self.entries else None

    @property
    def oldest(self) -> float | None:
        """Since when the longest waiter has waited (``_clock.stamp``)."""
        return min((since for _, _, since, _ in self.entries), default=None)


class DeploymentQueue:
    """Running slots and the line of waiters of one deployment."""

    def __init__(
        self,
        admission: Admission,
        *,
        max_running: int,
        max_waiting: int,
        gated: bool = False,
        holdup: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._admission, self.holdup = admission, holdup  # why it is not up yet (`Runner.holdup`)
        self.max_running, self.max_waiting = max_running, max_waiting
        self.running = 0
        self.open = not gated
        """Whether requests may take running slots now (see the module's docstring)."""
        self.idle_since = stamp()
        """When the last running request ended (``_clock.stamp``): the idle clock."""
        self.gap: float | None = None
        """Its clients' usual pause: a moving average of quiet spells a request ended at once."""
        self._waiters = Line()
        self._drained: asyncio.Event | None = None
        self._turn: asyncio.Event | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def oldest(self) -> float | None:
        """Since when the longest waiter has waited (``_clock.stamp``); None while none waits."""
        return self._waiters.oldest

    @property
    def quiet(self) -> bool:
        """No request runs or waits."""
        return self.running == 0 and not self._waiters.entries

    async def turned(self) -> None:
        """Return at its next turn from quiet to busy (a request comes) or back (none is left)."""
        if self._turn is None:
            self._turn = asyncio.Event()
        await self._turn.wait()

    async def acquire(self, deadline: float, priority: int = 0) -> None:
        """Take a running slot, waiting until ``deadline`` (``loop.time()``) at the latest,
        behind the waiters of a lower ``priority`` and those of its own that came before.

        Raises:
            QueueFullError: 429 ``queue_full`` when no place is left to wait.
            UnavailableError: 503 ``unavailable`` when the deadline passes while waiting.
        """
        if self.open and self.running < self.max_running and not self._waiters.entries:
            if self.running == 0:  # a quiet spell ends: how long its clients paused
                gap = _clock.now() - self.idle_since
                self.gap = gap if self.gap is None else self.gap + GAP_WEIGHT * (gap - self.gap)
                if self._turn is not None:
                    self._turned()
            self.running += 1
            return
        if len(self._waiters) >= self.max_waiting:
            raise QueueFullError("this model's waiting queue is full; retry shortly")
        if self._admission.waiting >= self._admission.max_waiting_total:
            raise QueueFullError("the gateway's waiting queue is full; retry shortly")
        self._turned(self.quiet)  # a request waits now for a deployment that had nothing to do
        entry = self._waiters.join(priority)
        waiter = entry[3]
        self._admission.waiting += 1
        try:
            async with asyncio.timeout_at(deadline):
                await waiter
        except TimeoutError:
            if _granted(waiter):
                return  # the slot arrived together with the deadline: keep it
            if not self.open:
                why = self.holdup() or "it goes on starting"
                raise UnavailableError(
                    f"the deployment was not ready within queue.request_deadline; {why}"
                ) from None
            raise UnavailableError("no running slot within queue.request_deadline") from None
        except BaseException:
            # A slot handed over just as we were cancelled must not be lost.
            if _granted(waiter):
                self.release()
            raise
        finally:
            self._admission.waiting -= 1
            if not waiter.done():
                waiter.cancel()
            self._waiters.leave(entry)
            self._turned(self.quiet)

    def release(self) -> None:
        """Give the slot back: to the longest waiter if there is one (and the gate is open)."""
        if self.open and self._waiters.entries and self._hand_over():
            return  # the slot passes on: running stays the same
        self.running -= 1
        if self.running == 0:
            self.idle_since = _clock.now()
            if self._drained is not None:
                self._drained.set()
            self._turned(not self._waiters.entries)

    def _turned(self, now: bool = True) -> None:
        if now and self._turn is not None:
            self._turn.set()
            self._turn = None

    def _hand_over(self) -> bool:
        """Give a slot to the longest waiter still waiting; whether there was one."""
        while (waiter := self._waiters.first()) is not None:
            if not waiter.done():
                waiter.set_result(None)
                return True
        return False

    def set_open(self, open_: bool) -> None:
        """Open or shut the gate; opening lets waiters in, oldest first, up to the bound."""
        self.open = open_
        while open_ and self.running < self.max_running and self._hand_over():
            self.running += 1

    def fail_waiters(self, error: Callable[[], GatewayError]) -> int:
        """Every waiter leaves with its own ``error()`` (what they waited for failed); how
        many there were."""
        failed = 0
        while (waiter := self._waiters.first()) is not None:
            if not waiter.done():
                waiter.set_exception(error())
                failed += 1
        return failed

    def slot(self, deadline: float, priority: int = 0) -> Slot:
        """``async with queue.slot(deadline)``: a running slot, held for the block."""
        return Slot(self, deadline, priority)

    async def drained(self, within_s: float) -> bool:
        """Wait until no request runs (at most ``within_s``); whether none does."""
        if self.running == 0:
            return True
        self._drained = event = asyncio.Event()
        try:
            async with asyncio.timeout(within_s):
                await event.wait()
        except TimeoutError:
            return self.running == 0
        finally:
            self._drained = None
        return True


def _order(entry: tuple[int, int, float, asyncio.Future[None]]) -> tuple[int, int]:
    return entry[0], entry[1]


def _granted(waiter: asyncio.Future[None]) -> bool:
    """Whether ``waiter`` was handed a slot (not failed, not cancelled)."""
    return waiter.done() and not waiter.cancelled() and waiter.exception() is None


class Slot:
    """A running slot of one deployment, taken on entry (waiting until ``deadline`` at the
    latest; the errors of `DeploymentQueue.acquire`) and given back on exit."""

    __slots__ = ("_deadline", "_priority", "_queue")

    def __init__(self, queue: DeploymentQueue, deadline: float, priority: int = 0) -> None:
        self._queue, self._deadline, self._priority = queue, deadline, priority

    async def __aenter__(self) -> None:
        await self._queue.acquire(self._deadline, self._priority)

    async def __aexit__(self, *exc: object) -> None:
        self._queue.release()


class BodyBudget:
    """The request-body bytes the whole gateway may hold at once, and one client (an address)
    of them: ``per_client`` (all of them where not given)."""

    __slots__ = ("_clients", "held", "limit", "per_client")

    def __init__(self, limit: int, per_client: int | None = None) -> None:
        self.limit = limit
        self.per_client = limit if per_client is None else per_client
        self.held = 0
        self._clients: dict[str, int] = {}
        """What each client holding any body holds (none other has an entry)."""

    def take(self, n: int, client: str = "") -> None:
        if self.held + n > self.limit:
            raise UnavailableError(
                "the gateway holds as many request bodies as it takes "
                "(limits.max_body_bytes_in_flight); retry shortly"
            )
        held = self._clients.get(client, 0) + n
        if held > self.per_client:
            raise UnavailableError(
                "this client's request bodies take all the gateway holds for one client "
                "(limits.max_body_bytes_per_client); retry shortly"
            )
        self._clients[client] = held
        self.held += n

    def give(self, n: int, client: str = "") -> None:
        self.held -= n
        left = self._clients.pop(client, 0) - n
        if left > 0:
            self._clients[client] = left
