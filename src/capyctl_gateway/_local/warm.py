"""One instance's warm cache on this machine: a llama-server's slots saved before it stops and
restored when it starts again, before it takes a request (the policy: ``_deployments/warm.py``;
the engine's routes: ``_deployments/slots.py``; a round: ``warmround.py``; the files:
``warmfiles.py``).

- The engine is launched with ``--slot-save-path`` at the instance's own directory (`flags`).
- `restore`, once a started engine answers and before it admits a request: the key is read
  (the engine's ``/props``, the model file it names, the launch flags), and the slots saved
  under an equal key go back, hottest first, each file checked first. A record saved under
  another key is refused before the engine sees it, and its files removed (this configuration
  can never use them); so is every file no record names.
- `save`, before an engine that served a request since its last save or restore is stopped:
  each idle slot is saved, the most recently used first (the engine's task counter says which),
  under a name of its own, checked, renamed into place and named in the record; the coldest
  saved slots go where the deployment would pass ``lifecycle.warm_cache_disk``.

Each round has ``lifecycle.warm_cache_timeout`` in all. Nothing here raises but cancellation:
a save or restore that fails, is refused or runs out of time is logged with why, counted and
shown, and costs only the warm cache (the instance serves cold).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from pathlib import Path

import aiohttp

from .._config import Deployment
from .._deployments.routes import EngineInstance
from .._deployments.warm import Round, WarmCounts, WarmKey, WarmShown
from .._log import event
from .warmfiles import InstanceDir
from .warmround import Restore, Save

__all__ = ["WarmCache"]

logger = logging.getLogger("capyctl_gateway")

NOT_KEPT = "not kept for this engine"
SILENT_S = 5.0
"""An engine that has answered none of its polls this long (or ``unresponsive_timeout``, if
shorter) is stopped without being asked to save its cache: a frozen one would hold its stop
for the warm cache's whole timeout."""


class WarmCache:
    """One instance's saved slots, and what it did with them (see the module's text)."""

    def __init__(
        self,
        inst: EngineInstance,
        deployment: Deployment,
        *,
        root: Path | None,
        session: aiohttp.ClientSession,
        lock: asyncio.Lock,
    ) -> None:
        self._name, self._session, self._lock = deployment.name, session, lock
        lc = deployment.lifecycle
        self._budget, self._timeout = lc.warm_cache_disk, lc.warm_cache_timeout
        self._quiet = min(SILENT_S, lc.unresponsive_timeout)
        self._why_off = _why_off(deployment, root)
        self._dir = InstanceDir(root, deployment.name, inst.index) if root is not None else None
        self._where, self._launch = inst.where, inst.launch
        self._key: WarmKey | None = None
        """The running engine's key, once `restore` read it: a save needs it."""
        self._slots = 0
        self._used = 0
        """Exchanges begun since the last save or restore: none, and the files are current."""
        self._rounds: dict[str, Round] = {}
        self._counts: Counter[str] = Counter()
        self._failures: Counter[tuple[str, str]] = Counter()
        self._held = self._dir.held() if self._dir is not None else 0
        """What its saved slots hold on disk, as of its last round (``status`` reads it)."""

    def flags(self) -> list[str]:
        """What the engine's command line gets: where it saves its slots, made first (the
        engine refuses a path that is not a directory); nothing where it cannot be made."""
        if self._why_off is not None or self._dir is None:
            return []
        try:
            self._dir.open()
        except OSError as exc:
            self._failed("restore", "failed", f"its directory: {exc}; it runs without one")
            return []
        return ["--slot-save-path", str(self._dir.path)]

    def began(self) -> None:
        """An exchange with the engine began (its slots may hold something new)."""
        self._used += 1

    def stopped(self) -> None:
        """The engine is gone: no save until the next start has read its key."""
        self._key = None

    async def restore(self, url: str, headers: dict[str, str]) -> str | None:
        """Give the started engine at ``url`` what was saved; what it got, in a phrase for the
        router line of its first request (None where it got nothing)."""
        if self._why_off is not None or self._dir is None:
            return None
        self._key, self._used = None, 0
        r = Restore(self._dir, self._session, url, headers, self._failed, self._timeout)
        self._key, self._slots = await r.run(self._launch)
        done = self._ended("restore", r.result())
        return (
            f"{_prefixes(done.prefixes)} restored, {done.tokens} tokens" if done.prefixes else None
        )

    async def save(self, url: str, headers: dict[str, str], silent_s: float | None) -> None:
        """Save the slots of the engine at ``url``, about to be stopped (see the module), unless
        it has answered none of its polls for ``silent_s`` (`SILENT_S`)."""
        if self._key is None or self._dir is None or not self._used:
            return
        if (silent_s or 0) > self._quiet:  # frozen: its stop would wait for the whole bound
            return
        async with self._lock:  # the deployment's instances share its budget
            s = Save(self._dir, self._session, url, headers, self._failed, self._timeout)
            await s.run(self._key, self._slots, self._budget)
        if s.failed is None:
            self._used = 0
        self._ended("save", s.result())

    def shown(self) -> WarmShown | None:
        """What ``status`` and the metrics show; None where the engine's kind keeps none."""
        if self._why_off == NOT_KEPT:
            return None
        c = self._counts
        counts = WarmCounts(
            c["saves"], c["restores"], c["saved_bytes"], c["restored_bytes"], dict(self._failures)
        )
        return WarmShown(
            self._why_off is None,
            self._why_off,
            self._budget,
            self._held,
            self._rounds.get("save"),
            self._rounds.get("restore"),
            counts,
        )

    def _failed(self, op: str, why: str, what: str) -> None:
        self._failures[(op, why)] += 1
        verb = "saved" if op == "save" else "restored"
        logger.warning("%s: its warm cache was not all %s (%s): %s", self._where, verb, why, what)

    def _ended(self, op: str, done: Round) -> Round:
        self._rounds[op] = done
        self._held = self._dir.held() if self._dir is not None else 0
        self._counts[f"{op}s"] += done.prefixes
        self._counts[f"{op}d_bytes"] += done.bytes
        if done.prefixes or op == "save":
            _said(self._where, self._name, op, done)
        return done


def _said(where: str, deployment: str, op: str, done: Round) -> None:
    """The ``warm_cache`` event of a round."""
    event(
        "warm_cache",
        "%s: %s %s (%d tokens, %d bytes) in %.3f s",
        where,
        f"{op}d",
        _prefixes(done.prefixes),
        done.tokens,
        done.bytes,
        done.duration_s,
        deployment=deployment,
        op=op,
        prefixes=done.prefixes,
        tokens=done.tokens,
        bytes=done.bytes,
        duration_s=round(done.duration_s, 3),
    )


def _why_off(d: Deployment, root: Path | None) -> str | None:
    """Why an instance of ``d`` keeps no warm cache; None where it keeps one."""
    if not d.lifecycle.warm_cache:
        return "lifecycle.warm_cache: off"
    if not d.warms:
        return NOT_KEPT
    return "no state directory" if root is None else None


def _prefixes(n: int) -> str:
    return f"{n} prefix" if n == 1 else f"{n} prefixes"
