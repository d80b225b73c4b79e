"""What a Pod object says of its engine, read as the kubelet and the scheduler write it."""

from __future__ import annotations

from typing import Any

__all__ = [
    "condition",
    "ended",
    "node_of",
    "pending",
    "phase",
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
