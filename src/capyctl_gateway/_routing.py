"""What the router's log lines and refusals say about a deployment's instances: each candidate's
score and the sample it came from, and why each other instance was skipped."""

from __future__ import annotations

from typing import Any

from ._deployments.routes import Route
from ._gateway import Gateway
from ._loop import running_loop

__all__ = ["candidates", "skipped"]


def skipped(gw: Gateway, route: Route) -> list[str]:
    """Why each instance of ``route`` that takes no request now is skipped."""
    out = []
    for i in route.instances:
        if i.unusable:
            out.append(f"{i.where}: {i.unusable}")
        elif i.remote is not None and gw.machines is not None:
            if i.remote not in gw.machines.sessions:
                out.append(f"{i.where}: host_session_lost")
            elif not i.available:
                out.append(f"{i.where}: dispatch_closed")
        elif not i.available:
            out.append(f"{i.where}: not ready")
    return out


def candidates(
    gw: Gateway, route: Route, exclude: set[int]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What a ``router_selection`` event shows: each instance that could take the request with
    its score and the sample it came from, and each one skipped with the reason."""
    loop_now, wall_now = running_loop().time(), gw.clock()
    chosen: list[dict[str, Any]] = []
    skipped_: list[dict[str, Any]] = []
    machines = gw.machines
    for i in route.instances:
        reason = None
        if i.index in exclude:
            reason = "not_accepted"
        elif i.unusable:
            reason = "failed_checks"
        elif i.remote is not None and machines is not None and i.remote not in machines.sessions:
            reason = "host_session_lost"
        elif not i.available:
            reason = "dispatch_closed"
        if reason is not None:
            skipped_.append({"instance": i.index, "host": i.host, "reason": reason})
            continue
        row: dict[str, Any] = {"instance": i.index, "host": i.host,
                               "router_in_flight": i.ledger.running}  # fmt: skip
        running = waiting = usage = age = None
        if i.remote is not None and machines is not None:
            r = machines.fresh(i, loop_now)
            sample = machines.samples.get(i.key)
            if r is not None and sample is not None:
                running, waiting, usage = r.running, r.waiting, r.usage
                age = loop_now - sample.received_at + (r.age_s or 0.0)
        elif gw.collector is not None:
            snap = gw.collector.snapshot(i.key)
            if snap is not None:
                m = snap.metrics
                running, waiting, age = m.running_requests, m.waiting_requests, None
                usage = m.kv_cache_usage_ratio or m.slot_usage_ratio
                age = wall_now - snap.requested_at
        engine = running is not None and waiting is not None
        row.update(
            engine_running=running, engine_waiting=waiting, usage=usage,
            sample_age_ms=None if age is None else round(age * 1000),
            load_source="engine" if engine else "router_in_flight", score=gw.load(i),
        )  # fmt: skip
        chosen.append(row)
    return chosen, skipped_
