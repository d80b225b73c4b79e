"""One round of an instance's warm cache: a restore once its engine has started, or a save before
it stops (``warm.py`` keeps what the rounds did). A round has one deadline for all its calls;
each step it cannot take is reported to the instance's `Book` (logged, counted) and ends the
round or skips the slot; nothing but cancellation leaves a round by raising.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import aiohttp

from .._clock import stamp, wall
from .._config import Launch
from .._deployments import slots
from .._deployments.slots import WarmCacheError
from .._deployments.warm import Round, Saved, SavedSlot, WarmKey, to_restore, within_budget
from .warmfiles import InstanceDir, flags_hash, model_identity

__all__ = ["Reported", "Restore", "Save", "key_of"]

Reported = Callable[[str, str, str], None]
"""How a round says a step did not happen: (``save`` or ``restore``, why, what)."""


async def key_of(props: slots.EngineProps, launch: Launch | None) -> WarmKey:
    """The key of the engine that says ``props`` of itself, launched as ``launch``."""
    try:
        model = await asyncio.to_thread(model_identity, Path(props.model_path))
    except OSError as exc:
        raise WarmCacheError(f"its model file cannot be read: {exc}", why="failed") from None
    flags = flags_hash(launch.command, launch.env) if launch is not None else ""
    return WarmKey("llamacpp", props.build, model, props.context, props.slots, flags)


class _Round:
    def __init__(
        self,
        d: InstanceDir,
        session: aiohttp.ClientSession,
        url: str,
        headers: dict[str, str],
        report: Reported,
        timeout_s: float,
    ) -> None:
        self.d, self.session, self.url, self.headers = d, session, url, headers
        self.report = report
        self.began = stamp()
        self.end = self.began + timeout_s
        self.moved = [0, 0, 0]
        """Slots, tokens and bytes moved."""
        self.failed: str | None = None

    def left(self) -> float:
        return self.end - stamp()

    def fail(self, op: str, why: str, what: str) -> None:
        self.report(op, why, what)
        self.failed = what

    def add(self, got: slots.Moved) -> None:
        self.moved = [self.moved[0] + 1, self.moved[1] + got.tokens, self.moved[2] + got.bytes]

    def load(self, op: str) -> Saved | None:
        """The instance's record (None, removed, where it is not one)."""
        try:
            return self.d.load()
        except ValueError as exc:
            self.fail(op, "invalid", f"its manifest: {exc}; removed")
            self.d.store(None)
            return None

    def result(self) -> Round:
        slots_, tokens, nbytes = self.moved
        return Round(slots_, tokens, nbytes, stamp() - self.began, wall(), self.failed)


class Restore(_Round):
    """Give a started engine what was saved under its key, hottest first."""

    async def run(self, launch: Launch | None) -> tuple[WarmKey | None, int]:
        """The engine's key and slot count (None, 0 where they could not be read)."""
        try:
            props = await slots.props(self.session, self.url, self.headers, self.left())
            key = await key_of(props, launch)
        except WarmCacheError as exc:
            self.fail("restore", exc.why, exc.message)
            return None, 0
        try:
            await self._restore(key, props.slots)
        except WarmCacheError as exc:
            self.fail("restore", exc.why, exc.message)
        except OSError as exc:
            self.fail("restore", "failed", f"its files: {exc}")
        return key, props.slots

    async def _restore(self, key: WarmKey, count: int) -> None:
        saved = self.load("restore")
        entries, refusal = to_restore(saved, key, count)
        if saved is not None and saved.slots and refusal is not None:
            self.fail("restore", "mismatch", f"{refusal}; its files are removed")
            saved = None
            self.d.store(None)
        self.d.tidy(saved)  # what no manifest names: a save cut short
        bad = []
        for s in entries:
            problem = self.d.problem(s)
            if problem is not None:  # checked before the engine sees it
                self.fail("restore", "invalid", f"slot {s.slot}: {problem}; dropped")
                bad.append(s.slot)
                continue
            try:
                got = await slots.restore(
                    self.session, self.url, self.headers, s.slot, s.file, self.left()
                )
            except WarmCacheError as exc:
                if exc.why != "refused":
                    raise
                self.fail("restore", "refused", f"slot {s.slot}: {exc.message}; dropped")
                bad.append(s.slot)
                continue
            self.add(got)
        if bad and saved is not None:
            self.d.store(saved.without(bad))
            self.d.tidy(saved.without(bad))


class Save(_Round):
    """Save an engine's idle slots, the most recently used first, within the disk budget."""

    async def run(self, key: WarmKey, count: int, budget: int) -> None:
        try:
            await self._save(key, count, budget)
        except WarmCacheError as exc:
            self.fail("save", exc.why, exc.message)
        except OSError as exc:
            self.fail("save", "failed", f"its files: {exc}")

    async def _save(self, key: WarmKey, count: int, budget: int) -> None:
        saved = self.load("save")
        saved = saved if saved is not None and saved.key == key else Saved(key)
        states = await slots.slots(self.session, self.url, self.headers, self.left())
        idle = [s for s in states if not s.processing and 0 <= s.id < count]
        idle.sort(key=lambda s: (s.task is None, -(s.task or 0)))  # the engine's task counter
        fresh: list[int] = []
        for rank, state in enumerate(idle):
            saved, got = await self._one(saved, state.id, rank)
            if got is None:
                continue
            fresh.append(state.id)
            saved, dropped = within_budget(saved, budget, self.d.others(), fresh)
            self.d.store(saved)
            self.d.remove(*(s.file for s in dropped))
            for s in dropped:
                what = f"slot {s.slot} ({s.bytes} bytes) past lifecycle.warm_cache_disk"
                self.fail("save", "over_budget", f"{what} ({budget} bytes): dropped")
            if all(s.slot != state.id for s in dropped):
                self.add(got)
        self.d.tidy(saved)

    async def _one(self, saved: Saved, slot: int, rank: int) -> tuple[Saved, slots.Moved | None]:
        """Save ``slot`` into a file of its own, then name it in the record: the record, and
        what was written (None for an empty slot). Raises WarmCacheError or OSError, its file
        removed."""
        nonce = os.urandom(6).hex()
        tmp, final = f"tmp-slot{slot}-{nonce}.bin", f"slot{slot}-{nonce}.bin"
        try:
            got = await slots.save(self.session, self.url, self.headers, slot, tmp, self.left())
            if got.tokens == 0:
                self.d.remove(tmp)
                return saved, None
            self.d.place(tmp, final, got.bytes)
        except (WarmCacheError, OSError, asyncio.CancelledError):
            self.d.remove(tmp)  # an engine still writing it writes to no name
            raise
        old = [s.file for s in saved.slots if s.slot == slot]
        saved = saved.with_slot(SavedSlot(slot, final, got.tokens, got.bytes, rank, wall()))
        self.d.store(saved)
        self.d.remove(*old)
        return saved, got
