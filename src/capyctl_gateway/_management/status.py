"""The ``status deployment`` document: a deployment, its instances as the collector sees them,
and the cut requests each instance still counts."""

from __future__ import annotations

from typing import Any

from .._gateway import Gateway

__all__ = ["deployment_status"]


def deployment_status(gateway: Gateway, name: str) -> dict[str, Any] | None:
    """The document for deployment ``name``; None when there is none of that name."""
    route = gateway.routes.get(name)
    if route is None:
        return None
    d = route.deployment
    now = gateway.now()
    collector = gateway.collector
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
        if collector is not None:
            status = collector.status(inst.key)
            row["state"] = status.state.value
            snap = status.latest
            if snap is not None:
                row["running"] = snap.metrics.running_requests
                row["waiting"] = snap.metrics.waiting_requests
                row["snapshot_age_s"] = round(snap.age_s(now), 3)
            if status.error:
                row["error"] = status.error
        if inst.unusable is not None:
            row["not_routed"] = inst.unusable
        instances.append(row)
    ready = any(i["state"] == "ready" for i in instances)
    return {
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
