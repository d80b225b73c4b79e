"""The ``status deployment`` document: a deployment, its instances as their runners see them,
and the cut requests each instance still counts."""

from __future__ import annotations

from typing import Any

from .._clock import stamp
from .._deployments.routes import EngineInstance, Route
from .._fleet import Fleet
from .._lifecycle.crash import backoff_left
from .._lifecycle.states import STARTABLE, DeploymentLife, Launched
from .._log import shown

__all__ = ["deployment_status", "instance_hosts", "shown"]


def deployment_status(fleet: Fleet, name: str) -> dict[str, Any] | None:
    """The document for deployment ``name``; None when there is none of that name."""
    route = fleet.routes.get(name)
    if route is None:
        return None
    life = fleet.lifecycle.lives.get(name)
    launched = {lc.inst.index: lc for lc in life.launched} if life is not None else {}
    now = fleet.now()
    instances = [_instance(inst, launched.get(inst.index), now) for inst in route.instances]
    ready = any(i["state"] == "ready" for i in instances)
    if life is not None:  # ready while an instance takes requests: its start waited for /health
        ready = any(inst.available and not inst.unusable for inst in route.instances)
    return {"deployment": _deployment(fleet, route, life, ready, instances), "instances": instances}


def _instance(inst: EngineInstance, lc: Launched | None, now: float) -> dict[str, Any]:
    """One instance's row: where it is, what its runner shows, what the router holds of it,
    and, for a launched one, what the lifecycle says (`_launched`)."""
    row: dict[str, Any] = {
        "index": inst.index,
        "url": inst.url,
        "host": inst.host,
        "machine": inst.machine,
        "state": "unknown",
        "running": None,
        "waiting": None,
        "snapshot_age_s": None,
        "router_running": inst.ledger.running,
        "routed": inst.unusable is None,
        "cancelled": [
            {
                "capyctl_request_id": c.request_id,
                "reason": c.reason,
                "age_s": round(now - c.cut_at, 3),
                "settles": c.rule.value,
            }
            for c in inst.ledger.cut
        ],
    }
    seen = inst.runner.describe()
    row.update(seen.fields)
    if seen.watched is not None:
        row["state"] = seen.watched
    if seen.lines:
        row["shown"] = [{"name": x.name, "text": x.text, "alarm": x.alarm} for x in seen.lines]
    if inst.unusable is not None:
        row["not_routed"] = inst.unusable
    if lc is not None:
        _launched(row, inst, lc, watched=seen.watched is not None)
    return row


def _launched(row: dict[str, Any], inst: EngineInstance, lc: Launched, *, watched: bool) -> None:
    """A launched instance's lifecycle state, its failures and restart backoff, its process."""
    row["lifecycle"] = lc.state.value
    if lc.state in STARTABLE and not lc.unconfirmed:
        row["url"] = None  # its engine is gone: the address it had is no one's now
    if not watched:  # nothing watches it: the lifecycle's word
        row["state"] = lc.state.value
    if lc.rested:  # parked (or stopped, or failed to wake) alone while the others serve
        row["spare"] = True
    if lc.failure is not None:
        row["failure"] = lc.failure
    if lc.crashes:
        row["failures_in_a_row"] = lc.crashes
        wait = backoff_left(lc, stamp())
        if wait > 0:
            row["restart_backoff_s"] = round(wait, 1)
    proc = inst.runner.process()
    if proc is not None:
        row["process"] = {"pid": proc.pid, "port": proc.port, "command": shown(proc.argv)}
        if proc.reaper_pid is not None:
            row["process"]["reaper_pid"] = proc.reaper_pid


def _deployment(
    fleet: Fleet,
    route: Route,
    life: DeploymentLife | None,
    ready: bool,
    instances: list[dict[str, Any]],
) -> dict[str, Any]:
    """The deployment's own part: what it serves, its state and queue, the engines' prefix
    cache hit ratio where they count it, and for a launched one its park and memory held."""
    d = route.deployment
    doc: dict[str, Any] = {
        "name": d.name,
        "id": route.id,
        "api": d.api.value,
        "engine": d.engine.value,
        "engine_version": d.engine_version,
        "served_model": d.engine_model,
        "state": _state(ready, life),
        "running": route.queue.running,
        "waiting": route.queue.waiting,
    }
    if len(route.instances) > 1:
        doc["routing"] = d.routing.policy
    counted = [i["prefix_cache"] for i in instances if "prefix_cache" in i]
    queried = sum(c["queried_tokens"] for c in counted)
    if queried:  # the engines' own counts since they started; absent where none counts
        hits = sum(c["hit_tokens"] for c in counted)
        doc["prefix_cache_hit_ratio"] = round(hits / queried, 4)
    if life is not None:
        doc["lifecycle"] = life.state
        # What a park does here (docs/gateway/lifecycle.md): sleep keeps the process up.
        doc["park"] = ("unload" if d.router else "sleep") if life.parks else "stop"
        if d.memory is not None:
            doc["memory_held"] = fleet.lifecycle.budget.held_by(life)
    return doc


def instance_hosts(fleet: Fleet, name: str) -> list[dict[str, Any]]:
    """Each instance of deployment ``name`` on a host: the host, the session, the sample's age."""
    out = []
    for inst in fleet.routes[name].instances:
        host = inst.runner.site.machine
        if host is None:
            continue
        sample = inst.runner.sample()
        age = round(sample.age_s, 3) if sample is not None else None
        session = inst.runner.describe().link or "lost"
        out.append({"instance": inst.index, "host": host, "session": session, "sample_age_s": age})
    return out


def _state(ready: bool, life: DeploymentLife | None) -> str:
    """``ready`` while an instance takes requests; ``standby`` for a deployment the gateway runs
    that nothing runs of now but the next request starts or wakes (parked, stopped when idle);
    ``unavailable`` otherwise (an operator stopped it, an engine someone else runs is down)."""
    if ready:
        return "ready"
    return "standby" if life is not None and life.refusal() is None else "unavailable"
