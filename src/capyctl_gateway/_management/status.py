"""The ``status deployment`` document: a deployment, its instances as the collector sees them,
and the cut requests each instance still counts."""

from __future__ import annotations

import asyncio
from typing import Any

from .._deployments.routes import EngineInstance
from .._gateway import Gateway
from .._lifecycle.states import HOLDING, InstanceState

__all__ = ["deployment_status", "instance_hosts", "shown"]


def deployment_status(gateway: Gateway, name: str) -> dict[str, Any] | None:
    """The document for deployment ``name``; None when there is none of that name."""
    route = gateway.routes.get(name)
    if route is None:
        return None
    d = route.deployment
    now = gateway.now()
    collector = gateway.collector
    life = gateway.lifecycle.lives.get(name)
    launched = {lc.inst.index: lc for lc in life.launched} if life is not None else {}
    collected = set(collector.keys()) if collector is not None else set()
    instances = []
    for inst in route.instances:
        row: dict[str, Any] = {
            "index": inst.index,
            "url": inst.url,
            "host": inst.host,
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
        if collector is not None and inst.key in collected:  # a stopped engine is not
            status = collector.status(inst.key)
            row["state"] = status.state.value
            snap = status.latest
            if snap is not None:
                row["running"] = snap.metrics.running_requests
                row["waiting"] = snap.metrics.waiting_requests
                row["snapshot_age_s"] = round(snap.age_s(now), 3)
            if status.error:
                row["error"] = status.error
        if inst.remote is not None and gateway.machines is not None:
            _remote_row(gateway, inst, row)
        if inst.unusable is not None:
            row["not_routed"] = inst.unusable
        lc = launched.get(inst.index)
        if lc is not None:
            row["lifecycle"] = lc.state.value
            if inst.key not in collected and inst.remote is None:
                row["state"] = lc.state.value
            if lc.failure is not None:
                row["failure"] = lc.failure
            proc = lc.process
            if proc is not None and proc.pid is not None:
                row["process"] = {"pid": proc.pid, "port": proc.port, "command": shown(proc.argv)}
        instances.append(row)
    ready = any(i["state"] == "ready" for i in instances)
    doc: dict[str, Any] = {
        "deployment": {
            "name": d.name,
            "api": d.api.value,
            "engine": d.engine.value,
            "engine_version": d.engine_version,
            "served_model": d.engine_model,
            "state": "ready" if ready else "unavailable",
            "running": route.queue.running,
            "waiting": route.queue.waiting,
        },
        "instances": instances,
    }
    if life is not None:
        memory = d.memory.ready if d.memory is not None else None
        doc["deployment"]["lifecycle"] = life.state
        # What a park does here (docs/gateway/lifecycle.md): sleep keeps the process up.
        doc["deployment"]["park"] = ("unload" if d.router else "sleep") if life.parks else "stop"
        if memory is not None and d.memory is not None:
            held = 0
            for lc in life.launched:
                if lc.state in HOLDING:
                    held += memory
                elif lc.state is InstanceState.PARKED:
                    held += d.memory.parked
            doc["deployment"]["memory_held"] = held
    return doc


def instance_hosts(gateway: Gateway, name: str) -> list[dict[str, Any]]:
    """Each remote instance of deployment ``name``: its host, the session, the sample's age."""
    machines = gateway.machines
    if machines is None:
        return []
    out = []
    loop_now = asyncio.get_running_loop().time()
    for inst in gateway.routes[name].instances:
        if inst.remote is None:
            continue
        sample = machines.samples.get(inst.key)
        fresh = machines.fresh(inst, loop_now)
        age = None
        if sample is not None and fresh is not None:
            age = round(loop_now - sample.received_at + (fresh.age_s or 0.0), 3)
        session = machines.session_state(inst.remote)
        out.append({"instance": inst.index, "host": inst.remote, "session": session,
                    "sample_age_s": age})  # fmt: skip
    return out


def _remote_row(gateway: Gateway, inst: EngineInstance, row: dict[str, Any]) -> None:
    """What an instance's host last reported of it, and how old that is."""
    machines = gateway.machines
    assert machines is not None and inst.remote is not None
    row["session"] = machines.session_state(inst.remote)
    sample = machines.samples.get(inst.key)
    if sample is None:
        return
    r = sample.report
    loop_now = asyncio.get_running_loop().time()
    row["state"] = "ready" if r.gate is not None and row["session"] == "live" else r.state
    row["report_age_s"] = round(loop_now - sample.received_at, 3)
    fresh = machines.fresh(inst, loop_now)
    if fresh is not None:
        row["running"], row["waiting"] = fresh.running, fresh.waiting
        row["snapshot_age_s"] = round(loop_now - sample.received_at + (fresh.age_s or 0.0), 3)
    row["ingress_in_flight"] = r.ingress_in_flight
    if r.pid is not None and r.command is not None:
        row["process"] = {"pid": r.pid, "port": r.port, "command": shown(r.command)}
    if r.failure is not None:
        row["failure"] = r.failure


_SECRET_FLAG = ("key", "token", "secret", "password")


def shown(argv: list[str]) -> list[str]:
    """A command line fit to show: the value of any flag that names a key, token, secret or
    password is masked (``--api-key X``, ``--api-key=X``)."""
    out: list[str] = []
    mask_next = False
    for arg in argv:
        name, eq, _ = arg.partition("=")
        secret = arg.startswith("-") and any(word in name.lower() for word in _SECRET_FLAG)
        if mask_next:
            out.append("***")
        elif secret and eq:
            out.append(f"{name}=***")
        else:
            out.append(arg)
        mask_next = secret and not eq
    return out
