"""What the gateway keeps across its own restarts, in one SQLite file under the state directory
(``<state>/gateway.sqlite3``): an operator's intent for each launched deployment (stopped by an
operator, started by one), the cut requests each instance still counts, and the engine
processes this machine runs (a restart waits for those a previous run left), and each
deployment's short ID.

A cut request is kept by the gateway's own request ID, its instance, when it was cut, by which
rule it settles and why; a caller's ``X-Request-Id`` is never stored. Writes are small and rare
(an operator's command, a cut, a settlement), made synchronously on the event loop.

Imports nothing of the gateway's rooms but the settlement's plain records.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ._deployments.settle import CutRequest, Settlement, SettleRule
from ._ulid import new_short_ids

if TYPE_CHECKING:
    from ._deployments.routes import Route
    from ._lifecycle.controller import Lifecycle

__all__ = ["Store", "restore"]

logger = logging.getLogger("capyctl_gateway")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS intent (
    deployment TEXT PRIMARY KEY,
    stopped INTEGER NOT NULL,
    started INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS cut (
    instance TEXT NOT NULL,
    request_id TEXT NOT NULL,
    cut_at REAL NOT NULL,
    rule TEXT NOT NULL,
    reason TEXT NOT NULL,
    PRIMARY KEY (instance, request_id)
);
CREATE TABLE IF NOT EXISTS deployment (
    name TEXT PRIMARY KEY,
    id TEXT NOT NULL UNIQUE
);
CREATE TABLE IF NOT EXISTS engine (
    instance TEXT PRIMARY KEY,
    pid INTEGER NOT NULL,
    started INTEGER NOT NULL
);
"""


class Store:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None)  # autocommit: one row a write
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    # -- deployments' short IDs ----------------------------------------------------------------
    def deployment_ids(self, names: list[str]) -> dict[str, str]:
        """Each deployment's short ID: the one it was given when first configured, or a new
        one (kept from now on). An ID stays with its name, also while the name is out of the
        configuration, so a deployment taken out and put back keeps it."""
        known = dict(self._db.execute("SELECT name, id FROM deployment").fetchall())
        new = new_short_ids((n for n in names if n not in known), known.values())
        self._db.executemany("INSERT INTO deployment VALUES (?, ?)", new.items())
        return {n: known.get(n) or new[n] for n in names}

    # -- engine processes this machine runs (a restart waits for a previous run's) -------------
    def engines(self) -> dict[str, tuple[int, int]]:
        """Each instance's engine process as recorded: (pid, its start time in clock ticks)."""
        rows = self._db.execute("SELECT instance, pid, started FROM engine")
        return {key: (int(pid), int(started)) for key, pid, started in rows}

    def engine_up(self, instance: str, pid: int, started: int) -> None:
        self._db.execute("INSERT OR REPLACE INTO engine VALUES (?, ?, ?)", (instance, pid, started))

    def engine_down(self, instance: str) -> None:
        self._db.execute("DELETE FROM engine WHERE instance = ?", (instance,))

    # -- operator intent --------------------------------------------------------------------
    def intent(self) -> dict[str, tuple[bool, bool]]:
        """Each deployment's (stopped, started) as an operator left it."""
        rows = self._db.execute("SELECT deployment, stopped, started FROM intent")
        return {name: (bool(stopped), bool(started)) for name, stopped, started in rows}

    def set_intent(self, deployment: str, *, stopped: bool, started: bool) -> None:
        self._db.execute(
            "INSERT INTO intent VALUES (?, ?, ?) ON CONFLICT(deployment) DO UPDATE SET "
            "stopped = excluded.stopped, started = excluded.started",
            (deployment, int(stopped), int(started)),
        )

    def remember(self, deployment: str, stopped: bool, started: bool) -> None:
        self.set_intent(deployment, stopped=stopped, started=started)

    # -- cut requests ------------------------------------------------------------------------
    def cuts(self) -> dict[str, list[CutRequest]]:
        found: dict[str, list[CutRequest]] = {}
        rows = self._db.execute(
            "SELECT instance, request_id, cut_at, rule, reason FROM cut ORDER BY cut_at"
        )
        for instance, rid, cut_at, rule, reason in rows:
            found.setdefault(instance, []).append(
                CutRequest(rid, float(cut_at), SettleRule(rule), reason)
            )
        return found

    def add_cut(self, instance: str, cut: CutRequest) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO cut VALUES (?, ?, ?, ?, ?)",
            (instance, cut.request_id, cut.cut_at, cut.rule.value, cut.reason),
        )

    def settled(self, instance: str, cuts: list[CutRequest], why: str = "") -> None:
        self.drop_cuts(instance, (c.request_id for c in cuts))

    def drop_cuts(self, instance: str, request_ids: Iterable[str]) -> None:
        self._db.executemany(
            "DELETE FROM cut WHERE instance = ? AND request_id = ?",
            [(instance, rid) for rid in request_ids],
        )


def restore(
    store: Store, routes: dict[str, Route], settlement: Settlement, lifecycle: Lifecycle
) -> None:
    """Take up what a previous run left: an operator's intent for each launched deployment, and
    the cut requests still counted. Those of an engine this gateway ran itself are settled as
    restarted (it stopped with the gateway); all others, those of an engine someone else runs
    and those of one a host runs (which outlives a server's restart), are counted again and
    settle by their rule: on a host, only by its report that the engine stopped or restarted
    (or, by their rule, that it was idle)."""
    for name, (stopped, started) in store.intent().items():
        life = lifecycle.lives.get(name)
        if life is not None:
            life.operator_stopped, life.operator_started = stopped, started
    instances = {i.key: i for r in routes.values() for i in r.instances}
    for key, cuts in store.cuts().items():
        inst = instances.get(key)
        if inst is None or (inst.launch is not None and not inst.runner.site.outlives_gateway):
            store.drop_cuts(key, (c.request_id for c in cuts))
            logger.info(
                "%s: %d cut request(s) from before the gateway's restart settled (%s)",
                key,
                len(cuts),
                "its engine starts afresh" if inst is not None else "no such instance now",
            )
            continue
        settlement.restore(inst.ledger, cuts)
        logger.info(
            "%s: %d cut request(s) from before the gateway's restart still counted",
            key,
            len(cuts),
        )
