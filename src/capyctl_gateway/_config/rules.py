"""Rules across a configuration's keys: what would load and then do nothing, or never work.

- The lifecycle keys and ``memory`` of a deployment whose instances are all ``url:`` (engines
  someone else runs): the gateway never starts, parks or stops those, nor counts their memory
  (in an operator's file: `load_config`).
- A launched deployment without ``memory`` under a budget, or one whose ``memory.ready``, times
  its launched instances on one machine, is more than the whole ``resources.memory_budget``: it
  could never start (every request would wait for room that cannot be made, then get a 503).
- Deployments kept ready (``activation: always``) that together hold more ready memory on one
  machine than the budget: one of them could never start, and would try again for ever.
- ``lifecycle.come_back`` with no budget, or on a deployment kept ready: no switch would ever
  take it out.
- A launch command that sets where the engine saves its cache (llama.cpp's
  ``--slot-save-path``) while the gateway keeps its warm cache there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._engines import FACTS
from .pods import KUBERNETES_POOL

if TYPE_CHECKING:
    from . import Deployment

__all__ = [
    "budget_problem",
    "kept_ready_problem",
    "size",
    "url_only_problem",
    "warm_problem",
    "warms",
]


def url_only_problem(deployments: Sequence[Deployment]) -> str | None:
    """Why a deployment of ``url:`` instances only may not carry its lifecycle keys or memory.

    Checked on an operator's file (`load_config`) only: the view a server sends a host sets
    ``lifecycle`` on every deployment placed there, whatever runs it."""
    for n, d in enumerate(deployments):
        if d.launched:
            continue
        why = (
            f"deployments.{n}: deployment {d.name!r} has only url: instances (engines someone "
            "else runs); the gateway never starts, parks or stops them"
        )
        for key in sorted(d.lifecycle.model_fields_set):
            return f"{why}, so lifecycle.{key} would do nothing; remove it"
        if d.memory is not None:
            return f"{why} nor counts their memory, so memory would do nothing; remove it"
    return None


def warms(d: Deployment) -> bool:
    """Whether what ``d``'s engines cached is saved before they stop and restored when they
    start (``lifecycle.warm_cache``, where the engine's kind allows it: one-model llama.cpp
    servers this gateway runs on its own machine)."""
    return (
        d.lifecycle.warm_cache
        and FACTS[d.engine].warm_flag is not None
        and d.launched
        and not d.router
        and not d.on_pods
        and not d.remote
    )


def warm_problem(d: Deployment, command: Sequence[str]) -> str | None:
    """Why ``command`` may not run for ``d``: it sets where the engine saves its cache, which
    is the gateway's while it keeps ``d``'s warm cache."""
    flag = FACTS[d.engine].warm_flag
    if d.warms and any(a.split("=", 1)[0] == flag for a in command):
        return f"sets {flag}, where the gateway keeps its warm cache (lifecycle.warm_cache: off)"
    return None


def budget_problem(d: Deployment, budget: int | None) -> str | None:
    """Why ``d`` cannot run under ``budget``: a launched deployment that does not say what it
    holds, or one whose instances on one machine hold more ready than all of it; or one marked
    to come back that nothing would ever switch out."""
    if d.lifecycle.come_back and (budget is None or d.lifecycle.activation == "always"):
        why = "there is no resources.memory_budget" if budget is None else "it is kept ready"
        return (
            f"deployment {d.name!r}: lifecycle.come_back would do nothing: {why}, so no "
            "switch ever takes it out"
        )
    if budget is None or not d.launched:
        return None
    if d.memory is None:
        return (
            f"deployment {d.name!r}: memory is required when resources.memory_budget is set "
            "(what one instance holds ready and parked)"
        )
    per_machine = Counter(i.pool for i in d.instances if i.launch is not None)
    most = max(per_machine.values(), default=0)
    need = d.memory.ready * most
    if need <= budget:
        return None
    times = f" x {most} launched instances in one memory pool = {size(need)}" if most > 1 else ""
    return (
        f"deployment {d.name!r}: memory.ready {size(d.memory.ready)}{times} is more than the "
        f"whole resources.memory_budget {size(budget)}; it could never start"
    )


def kept_ready_problem(deployments: Sequence[Deployment], budget: int | None) -> str | None:
    """Why the deployments kept ready (``activation: always``) cannot all be ready at once."""
    if budget is None:
        return None
    held: Counter[str | None] = Counter()
    for d in deployments:
        if d.lifecycle.activation == "always" and d.memory is not None:
            for i in d.instances:
                if i.launch is not None:
                    held[i.pool] += d.memory.ready
    for host, need in held.items():
        if need > budget:
            where = "this machine" if host is None else _pool_name(host)
            return (
                f"the deployments with lifecycle.activation: always hold {size(need)} ready on "
                f"{where}, more than resources.memory_budget {size(budget)}: they cannot all "
                "be kept ready"
            )
    return None


def _pool_name(pool: str) -> str:
    return "Kubernetes" if pool == KUBERNETES_POOL else f"host {pool}"


def size(n: int) -> str:
    """A size as an operator writes it: ``15GiB``, ``512MiB``, ``100B``."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor:
            return f"{n / factor:.4g}{unit}"
    return f"{n}B"


_SECTIONS = {"queue", "limits", "resources", "kubernetes"}
_DEPLOYMENT_SECTIONS = {"lifecycle", "routing"}
_LAUNCH_SECTIONS = {"env", "logs"}


def empty_sections_dropped(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` without the sections written with nothing under them (``resources:`` alone is
    YAML's null): such a section means its defaults, as if it were not written."""

    def drop(d: Any, keys: set[str]) -> Any:
        if not isinstance(d, dict):
            return d
        return {k: v for k, v in d.items() if not (k in keys and v is None)}

    out: dict[str, Any] = drop(raw, _SECTIONS)
    deployments = out.get("deployments")
    if not isinstance(deployments, list):
        return out
    out["deployments"] = [drop(d, _DEPLOYMENT_SECTIONS) for d in deployments]
    for d in out["deployments"]:
        instances = d.get("instances") if isinstance(d, dict) else None
        if not isinstance(instances, list):
            continue
        d["instances"] = [
            {**i, "launch": drop(i["launch"], _LAUNCH_SECTIONS)}
            if isinstance(i, dict) and isinstance(i.get("launch"), dict)
            else i
            for i in instances
        ]
    return out
