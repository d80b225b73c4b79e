"""The deletes the gateway owes: a pod it deleted, or must delete, that is not provably gone.

A delete the API server refused (a 500, 429 or 503, or no answer at all), a pod still there past
its grace period and `STOP_PROOF_MARGIN_S`, a pod a create may have stored without saying so:
each becomes a `Debt`, paid by a loop of its own in the cluster's supervisor (a defect in it is
logged and counted, and the loop goes on). The loop deletes the pod again after a jittered
backoff, from `OWED_FIRST_S` doubling to `OWED_MAX_S`, for as long as the namespace's watch has
the pod (or cannot say: while it is down, nothing is concluded from silence), and the debt is
paid once a watch that runs shows the pod gone, or the API answers 404 (or 409: its name has
another uid now).

Until then the pod may hold its GPU: the instance's stop stays unproven (its memory and cut
requests stay counted, its memory apart from what a new start reserves), and ``status`` shows
the debt and why it is owed. The instance's next start makes no new pod while an earlier one
runs on undeleted (`Debt.blocks`: never two running pods for one instance); one Kubernetes is
deleting (Terminating: on a lost node it may stay so until the node is back) does not hold the
new start up.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._clock import stamp
from .._errors import StartFailedError
from .podstate import terminating

if TYPE_CHECKING:
    from .podrun import PodRun
    from .watch import PodWatch

__all__ = ["OWED_FIRST_S", "OWED_MAX_S", "Debt", "holding", "settled"]

OWED_FIRST_S = 0.5
"""The first wait before an owed delete is tried again."""
OWED_MAX_S = 30.0
"""The longest wait between two tries of an owed delete."""


@dataclass(eq=False)
class Debt:
    """One pod the gateway owes a delete."""

    run: PodRun
    owner: str
    """The instance whose pod it is (``deployment x instance 0``), or the pod itself for a
    previous run's pod no instance takes up."""
    why: str
    grace_s: int
    failed: int = 0
    """Tries in a row that did not prove it gone."""
    tries: int = 0
    error: str | None = None
    """Why the last try did not prove it gone."""
    since: float = field(default_factory=stamp)
    paid: asyncio.Event = field(default_factory=asyncio.Event)

    async def turn(self) -> bool:
        """One try (after its backoff, unless the pod goes meanwhile); whether it is gone."""
        run = self.run
        if self.failed:
            wait = min(OWED_FIRST_S * 2 ** (self.failed - 1), OWED_MAX_S)
            wait *= random.uniform(0.5, 1.0)  # noqa: S311 (jitter)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await run.gone()
        if run.uid is not None and run.gone_now():  # one known by name alone: a 404 says
            return True
        self.tries += 1
        self.error = await run.delete(self.grace_s)
        if self.error is None:
            return True
        self.failed += 1
        return False

    def blocks(self) -> bool:
        """Whether its pod may run on undeleted: the API server has not taken its delete (a
        pod marked for deletion goes by Kubernetes' own doing)."""
        pod = self.run.pod()
        if pod is None:
            return not self.run.gone_now()
        return not terminating(pod)

    def row(self) -> dict[str, Any]:
        """What ``status`` shows of it."""
        row: dict[str, Any] = {"name": self.run.name, "namespace": self.run.namespace}
        row["why"] = self.why
        row["tries"] = self.tries
        if self.error is not None:
            row["error"] = self.error
        row["owed_s"] = round(stamp() - self.since, 1)
        return row


def holding(debts: list[Debt]) -> str | None:
    """Why a start waits for ``debts`` (an earlier pod running on undeleted); None if not."""
    for d in debts:
        if d.blocks():
            return f"its previous pod {d.run.name} is not deleted yet ({d.why})"
    return None


async def settled(
    owed_by: Callable[[str], list[Debt]], owner: str, w: PodWatch, within_s: float
) -> None:
    """Wait (``within_s``) until no earlier pod of ``owner`` runs on undeleted (`Debt.blocks`):
    no second running pod is made beside one. Raises StartFailedError past ``within_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while debts := [d for d in owed_by(owner) if d.blocks()]:
        left = deadline - loop.time()
        if left <= 0:
            raise StartFailedError(
                f"its previous pod {debts[0].run.name} is not deleted yet ({debts[0].why}); "
                "no second pod is made beside it",
                began=False,
                lingers=True,
            )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(left):
                await w.changed()  # a pod's deletion, its DELETED event
