"""What a Pod object says of its engine, read as the kubelet and the scheduler write it."""

from __future__ import annotations

from typing import Any

from .._deployments.runner import Shown

__all__ = [
    "condition",
    "ended",
    "lines",
    "node_of",
    "pending",
    "phase",
    "placed",
    "pod_url",
    "ready",
    "serving",
    "shown",
    "terminating",
]


def _status(pod: dict[str, Any]) -> dict[str, Any]:
    s = pod.get("status")
    return s if isinstance(s, dict) else {}


def phase(pod: dict[str, Any]) -> str:
    return str(_status(pod).get("phase") or "Pending")


def condition(pod: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for c in _status(pod).get("conditions") or ():
        if isinstance(c, dict) and c.get("type") == kind:
            return c
    return None


def ready(pod: dict[str, Any]) -> bool:
    c = condition(pod, "Ready")
    return c is not None and c.get("status") == "True" and phase(pod) == "Running"


def terminating(pod: dict[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def serving(pod: dict[str, Any]) -> bool:
    """Ready, not being deleted, its engine not ended: a pod whose engine takes requests."""
    return ready(pod) and not terminating(pod) and ended(pod) is None


def node_of(pod: dict[str, Any]) -> str | None:
    node = (pod.get("spec") or {}).get("nodeName")
    return str(node) if node else None


def pod_url(pod: dict[str, Any], port: int) -> str | None:
    ip = _status(pod).get("podIP")
    if not ip:
        return None
    host = f"[{ip}]" if ":" in str(ip) else str(ip)
    return f"http://{host}:{port}"


def pending(pod: dict[str, Any], *, detail: bool = True) -> str | None:
    """Why the pod waits to run, as the scheduler or the kubelet says (None when it runs or
    nothing has been said): the scheduler's message for a pod it cannot place, a container's
    waiting reason (an image that cannot be pulled), with the kubelet's message where
    ``detail`` (it may name a registry's address: not for clients)."""
    c = condition(pod, "PodScheduled")
    if c is not None and c.get("status") == "False":
        return f"{c.get('reason') or 'Unschedulable'}: {c.get('message') or 'no node fits'}"
    for cs in _status(pod).get("containerStatuses") or ():
        waiting = ((cs or {}).get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason and reason not in ("ContainerCreating", "PodInitializing"):
            message = waiting.get("message") if detail else None
            return f"{reason}: {message}" if message else str(reason)
    return None


def ended(pod: dict[str, Any]) -> str | None:
    """Why the pod's engine is gone (its container ended, the pod failed or was evicted), or
    None while it may run."""
    status = _status(pod)
    for cs in status.get("containerStatuses") or ():
        term = ((cs or {}).get("state") or {}).get("terminated")
        if isinstance(term, dict):
            code = term.get("exitCode")
            why = term.get("reason") or "Error"
            signal = f", signal {term['signal']}" if term.get("signal") else ""
            return f"its container ended ({why}, exit code {code}{signal})"
    if phase(pod) in ("Failed", "Succeeded"):
        reason = status.get("reason") or phase(pod)
        message = status.get("message")
        return f"its pod {reason}" + (f": {message}" if message else "")
    return None


def shown(pod: dict[str, Any]) -> dict[str, Any]:
    """What ``status`` shows of the pod: its name, namespace, phase, node and why it waits."""
    meta = pod.get("metadata") or {}
    row: dict[str, Any] = {"name": meta.get("name"), "namespace": meta.get("namespace")}
    row["phase"] = phase(pod)
    if (node := node_of(pod)) is not None:
        row["node"] = node
    if (why := pending(pod)) is not None:
        row["waiting"] = why
    return row


def placed(row: dict[str, Any]) -> str:
    """Where a pod runs, in a line of ``list`` (from its `shown` row)."""
    on = f" on node {row['node']}" if row.get("node") else ""
    waits = f"; it waits: {row['waiting']}" if row.get("waiting") else ""
    return f"pod {row['namespace']}/{row['name']}{on}, {row['phase']}{waits}"


def lines(fields: dict[str, Any]) -> tuple[Shown, ...]:
    """What ``status`` prints under a pod's instance: the pod (``shown``), the watch when it is
    down, each delete owed."""
    out: list[Shown] = []
    if (row := fields.get("pod")) is not None:
        on = f" on node {row['node']}" if row.get("node") else ""
        waits = f"; it waits: {row['waiting']}" if row.get("waiting") else ""
        text = f"pod {row['namespace']}/{row['name']}{on}: {row['phase']}{waits}"
        out.append(Shown("pod", text, alarm=bool(waits)))
    if watch := fields.get("pod_watch"):
        out.append(Shown("pod_watch", f"the pod watch is {watch}", alarm=True))
    for owed in fields.get("pod_deletes_owed", ()):
        tries = f"; {owed['tries']} tries" if owed.get("tries") else ""
        last = f", the last: {owed['error']}" if owed.get("error") else ""
        text = (
            f"pod {owed['namespace']}/{owed['name']}: its delete is owed for "
            f"{owed['owed_s']:.0f} s ({owed['why']}{tries}{last}); tried again until it is gone"
        )
        out.append(Shown("pod_delete_owed", text, alarm=True))
    return tuple(out)
