"""Creating a pod for one start of an instance's engine.

A create carries the name the gateway chose before the call, so an answer lost on the way (a
cut connection, a timeout, a 5xx after the API server may have stored the pod) is not a pod
lost: the create is tried again under the same name (`CREATE_TRIES` within `CREATE_WITHIN_S`,
a jittered backoff between), and a 409 ``AlreadyExists`` finds the pod the first try made (read
back by name, and taken up when its labels are this instance's). A create that never gets an
answer leaves a pod that may exist: its delete is owed by name (``deletes.py``), and the start
fails saying so, with its memory counted until the pod is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, stop_after_delay
from tenacity.wait import wait_exponential_jitter

from .._errors import StartFailedError
from .cluster import Adopter, Cluster
from .kube import KubeError
from .podrun import PodRun
from .watch import uid_of

__all__ = ["CREATE_TRIES", "CREATE_WITHIN_S", "create"]

logger = logging.getLogger("capyctl_gateway")

CREATE_TRIES = 4
"""Tries of one pod's create while the API server cannot be reached or answers 429 or 5xx."""
CREATE_WITHIN_S = 20.0
"""The longest those tries take together, their waits included."""
LOST = (0, 500, 502, 503, 504)
"""A create answered so (none, or a server's failure) may have stored the pod all the same."""
TRANSIENT = (*LOST, 429)
READ_BACK_S = 5.0
"""How long a pod whose create's answer was lost is looked for on the watch before a get."""


def _grace(body: dict[str, Any]) -> int:
    return int(body["spec"].get("terminationGracePeriodSeconds") or 30)


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, KubeError) and exc.status in TRANSIENT


def _retrying() -> AsyncRetrying:
    """Tries of one call while the API server cannot be reached or answers 429 or 5xx."""
    return AsyncRetrying(
        stop=stop_after_attempt(CREATE_TRIES) | stop_after_delay(CREATE_WITHIN_S),
        wait=wait_exponential_jitter(multiplier=0.2, max=5.0, jitter=0.2),
        retry=retry_if_exception(_transient),
        sleep=asyncio.sleep,
        reraise=True,
    )


async def create(cluster: Cluster, body: dict[str, Any], runner: Adopter) -> PodRun:
    """Create the pod ``body`` (named); its run. Raises StartFailedError, saying whether the
    API could not be reached or refused it (its reason; the whole message is logged);
    ``lingers`` when a pod may have been stored all the same (its delete is then owed)."""
    meta = body["metadata"]
    ns, name = str(meta["namespace"]), str(meta["name"])
    api, where = cluster.api, runner.instance.where
    maybe = sent = False  # an earlier try may have stored it; a try was sent
    try:
        async for attempt in _retrying():
            with attempt:
                sent = True
                try:
                    made = await api.create(ns, body)
                except KubeError as exc:
                    maybe = maybe or exc.status in LOST
                    if exc.status == 409 and maybe:  # the lost try's pod: ours by name
                        return await _found(cluster, body, runner)
                    if _transient(exc):
                        logger.warning("%s: its pod's create failed (%s); trying again", where, exc)
                    raise
                return PodRun(cluster, ns, name, uid_of(made))
        raise AssertionError("unreachable: tenacity reraises")  # pragma: no cover
    except KubeError as exc:
        logger.error("%s: its pod was not created: %s", where, exc)
        if maybe:  # it may exist: deleted by name, its memory counted until it is gone
            run = PodRun(cluster, ns, name, None)
            why = "its create was never answered"
            cluster.owe(run, where, why, grace_s=_grace(body), runner=runner, tried=False)
            raise StartFailedError(
                "the Kubernetes API did not answer its pod's create; "
                f"the pod {name} is deleted in case it was made",
                began=False,
                lingers=True,
            ) from None
        if exc.status == 0:
            raise StartFailedError("the Kubernetes API could not be reached", began=False) from None
        raise StartFailedError(f"Kubernetes refused its pod ({exc.reason})", began=False) from None
    except BaseException:  # abandoned (an operator's stop) with a try sent: it may exist
        if sent:
            why = "its start was abandoned as its pod was created"
            run = PodRun(cluster, ns, name, None)
            cluster.owe(run, where, why, grace_s=_grace(body), runner=runner, tried=False)
        raise


async def _found(cluster: Cluster, body: dict[str, Any], runner: Adopter) -> PodRun:
    """The pod an earlier try of this create stored (its answer lost), read back by name."""
    meta = body["metadata"]
    ns, name = str(meta["namespace"]), str(meta["name"])
    where = runner.instance.where
    try:
        pod = await _read_back(cluster, ns, name)
    except KubeError:
        pod = None
    labels = ((pod or {}).get("metadata") or {}).get("labels") or {}
    if pod is None or any(labels.get(k) != v for k, v in meta["labels"].items()):
        if pod is None:  # unread: deleted by name in case it is there
            cluster.owe(
                PodRun(cluster, ns, name, None),
                where,
                "its create's answer was lost",
                grace_s=_grace(body),
                runner=runner,
                tried=False,
            )
        raise StartFailedError(
            f"its pod {name} was made, but could not be read back",
            began=False,
            lingers=pod is None,
        )
    logger.info("%s: its pod %s was made by a create whose answer was lost", where, name)
    return PodRun(cluster, ns, name, uid_of(pod))


async def _read_back(cluster: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    """The pod ``name`` as its namespace's watch has it (within `READ_BACK_S`), else as a get
    answers it (tried as a create is). Raises KubeError."""
    w = cluster.watch(ns)
    if w is not None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(READ_BACK_S):
                while (pod := w.pods.get(name)) is None:
                    await w.changed()
                return pod
    async for attempt in _retrying():
        with attempt:
            return await cluster.api.get(ns, name)
    raise AssertionError("unreachable: tenacity reraises")  # pragma: no cover
