"""What the router's log lines and refusals say about a deployment's instances: the line for
each choice and each failover (`log_route`), each candidate's score and the sample it came
from, and why each other instance was skipped. The score is the one routing weighs
(`load_of`), from the same `LoadSample`, beside the prefix blocks each instance holds."""

from __future__ import annotations

from typing import Any, Protocol

from .._config import Deployment
from .._deployments.routes import EngineInstance, Route, load_of, offerable
from .._log import event
from .choose import Choice

__all__ = ["Named", "candidates", "closed_reason", "log_route", "skipped"]


class Named(Protocol):
    """What a router line names of a request: its ID, its caller's and its deployment."""

    @property
    def rid(self) -> str: ...

    @property
    def caller(self) -> str | None: ...

    @property
    def dep(self) -> Deployment: ...


def log_route(
    name: str,
    call: Named,
    route: Route,
    instance: EngineInstance,
    detail: str | None = None,
    **more: Any,
) -> None:
    """A router line: ``request <ID> (caller <theirs>) <deployment ID> -> <machine> instance
    <N>`` for a selection, or why an instance did not take the request for a failover."""
    fields: dict[str, Any] = {
        "capyctl_request_id": call.rid,
        "deployment": call.dep.name,
        "deployment_id": route.id,
        "instance": instance.index,
        "host": instance.host,
        "machine": instance.machine,
        **more,
    }
    if call.caller is not None:
        fields["caller_request_id"] = call.caller
    caller = f" (caller {call.caller})" if call.caller is not None else ""
    if name == "router_selection":
        event(
            name,
            "request %s%s %s -> %s instance %d%s",
            call.rid,
            caller,
            route.id,
            instance.machine,
            instance.index,
            _why(instance, more),
            **fields,
        )
    else:
        event(
            name,
            "request %s%s %s: instance %d on %s did not take it (%s)",
            call.rid,
            caller,
            route.id,
            instance.index,
            instance.machine,
            detail,
            **fields,
            reason="not_accepted",
            detail=detail,
        )


def _why(instance: EngineInstance, more: dict[str, Any]) -> str:
    """The text line's reason for a choice among several instances: ``(prefix: 12 of 40 blocks,
    load 1)``; nothing for a lone instance; and for the first request on an instance since its
    warm cache was restored, what was: ``(warm: 1 prefix restored, 9333 tokens)``."""
    warm = f" (warm: {more['warm_cache']})" if "warm_cache" in more else ""
    warm += f" ({spare_text(more['spare'])})" if "spare" in more else ""
    why = more.get("why")
    if why is None:
        return warm
    rows: list[dict[str, Any]] = more.get("candidates", [])
    mine = next((c for c in rows if c["instance"] == instance.index), {})
    parts = [str(why)]
    if "prefix_blocks" in more:
        parts[0] += f": {mine.get('matched_blocks', 0)} of {more['prefix_blocks']} blocks"
    if "score" in mine:
        parts.append(f"load {mine['score']}")
    stale = sum(1 for s in more.get("skipped", ()) if s["reason"] == "stale_sample")
    if stale:
        parts.append(f"{stale} passed over for a stale sample")
    return f" ({', '.join(parts)}){warm}"


def spare_text(row: dict[str, Any]) -> str:
    """What a router line says of a rested spare (`Spare.row`): ``spare: wake, woke instance
    1; a wait of 6.0 s, a wake of 2.0 s``."""
    wait = "not measured" if row["wait_s"] is None else f"{row['wait_s']:.1f} s"
    return f"spare: {row['chose']}, {row['why']}; a wait of {wait}, a wake of {row['wake_s']:.1f} s"


def closed_reason(i: EngineInstance) -> str:
    """Why an instance that takes no request now takes none: its machine cannot be reached
    (``host_session_lost``), or it admits none (``dispatch_closed``: a host's gate is shut, an
    engine is not ready or is being drained)."""
    return "dispatch_closed" if i.reachable else i.runner.why_unreachable()


def skipped(route: Route) -> list[str]:
    """Why each instance of ``route`` that takes no request now is skipped."""
    out = []
    for i in route.instances:
        if i.unusable:
            out.append(f"{i.where}: {i.unusable}")
        elif not i.available:
            out.append(f"{i.where}: {closed_reason(i)}")
    return out


def candidates(
    route: Route, exclude: set[int] | frozenset[int], choice: Choice
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What a ``router_selection`` event shows: each instance that could take the request with
    its score, the sample it came from and the prefix blocks it holds (prefix routing), and
    each one skipped with the reason (an instance resting after it failed to accept a request:
    ``not_accepted_recently``, with the rest's time left; one without a fresh load sample
    while another has one: ``stale_sample``)."""
    chosen: list[dict[str, Any]] = []
    skipped_: list[dict[str, Any]] = []

    def prefix(index: int) -> dict[str, int]:
        if route.prefixes is None:
            return {}
        return {"matched_blocks": choice.matched.get(index, 0)}

    open_ = [i for i in route.instances if offerable(i, exclude)]
    # Resting instances are passed over only while another can take the request (Route.choose).
    rests = {i.index: route.rest_left(i) for i in open_}
    others = not all(rests.values())
    for i in route.instances:
        reason = None
        row: dict[str, Any] = {"instance": i.index, "host": i.host}
        if i.index in exclude:
            reason = "not_accepted"
        elif i.unusable:
            reason = "failed_checks"
        elif not i.available:
            reason = closed_reason(i)
        elif others and rests[i.index]:
            reason = "not_accepted_recently"
            row["rest_left_ms"] = round(rests[i.index] * 1000)
        elif i.index in choice.stale:
            reason = "stale_sample"
        if reason is not None:
            skipped_.append({**row, "reason": reason})
            continue
        s = choice.samples[i.index] if i.index in choice.samples else i.runner.sample()
        engine = s is not None and s.counted
        chosen.append(
            {
                "instance": i.index,
                "host": i.host,
                "router_in_flight": i.ledger.running,
                "engine_running": s.running if s else None,
                "engine_waiting": s.waiting if s else None,
                "usage": s.usage if s else None,
                "sample_age_ms": round(s.age_s * 1000) if s else None,
                "load_source": "engine" if engine else "router_in_flight",
                "score": load_of(i, s),
                **prefix(i.index),
            }
        )
    return chosen, skipped_
