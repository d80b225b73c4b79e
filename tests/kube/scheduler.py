"""The fake scheduler: nodes, and binding Pending pods to them with the default scheduler's
filters in its order (NodeUnschedulable, TaintToleration, NodeAffinity, NodeResourcesFit) and
its words when nothing fits ("0/2 nodes are available: 2 Insufficient nvidia.com/gpu.
preemption: ...").

Departures: no preemption (there are never victims); init containers, pod overhead, host ports
and (anti-)affinity between pods are not considered; of the fitting nodes the one with the most
free room (summed over its resources, as fractions) wins; a lost node is only marked by the
``node.kubernetes.io/unreachable`` taints (there are no Node objects in the API).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from tests.kube.objects import now, parse_quantity
from tests.kube.store import Store

__all__ = ["FakeNode", "Scheduler"]

Obj = dict[str, Any]
UNREACHABLE = "node.kubernetes.io/unreachable"
UNSCHEDULABLE = "node.kubernetes.io/unschedulable"


def _default_allocatable() -> dict[str, str]:
    return {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "1"}


@dataclass
class FakeNode:
    """A node: what it can give, its labels (the usual kubernetes.io ones added) and taints
    (``{"key", "value", "effect"}``)."""

    name: str
    allocatable: dict[str, str] = field(default_factory=_default_allocatable)
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, str]] = field(default_factory=list)
    unschedulable: bool = False  # cordoned
    lost: bool = False  # its kubelet stopped posting status

    def __post_init__(self) -> None:
        self.allocatable, self.labels = dict(self.allocatable), dict(self.labels)
        self.labels.setdefault("kubernetes.io/hostname", self.name)
        self.labels.setdefault("kubernetes.io/os", "linux")
        self.allocatable.setdefault("pods", "110")

    def all_taints(self) -> list[dict[str, str]]:
        extra = (
            [{"key": UNREACHABLE, "effect": e} for e in ("NoSchedule", "NoExecute")]
            if self.lost
            else []
        )
        return self.taints + extra


Usage = dict[str, Fraction]


def requests(pod: Obj) -> Usage:
    """What a pod asks of a node (requests; the server already defaulted them from limits)."""
    total: Usage = {"pods": Fraction(1)}
    for c in pod["spec"]["containers"]:
        for key, value in ((c.get("resources") or {}).get("requests") or {}).items():
            total[key] = total.get(key, Fraction(0)) + parse_quantity(value)
    return total


def _add(into: Usage, more: Usage) -> None:
    for key, value in more.items():
        into[key] = into.get(key, Fraction(0)) + value


def tolerates(tolerations: list[Obj], taint: Obj) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator", "Equal") == "Exists":
            if not t.get("key") or t["key"] == taint["key"]:
                return True
        elif t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def _term_matches(term: Obj, node: FakeNode) -> bool:
    for expr in term.get("matchExpressions") or []:
        have, op, values = node.labels.get(expr["key"]), expr["operator"], expr.get("values") or []
        ok = {
            "In": have is not None and have in values,
            "NotIn": have is None or have not in values,
            "Exists": have is not None,
            "DoesNotExist": have is None,
            "Gt": have is not None and have.lstrip("-").isdigit() and int(have) > int(values[0]),
            "Lt": have is not None and have.lstrip("-").isdigit() and int(have) < int(values[0]),
        }[op]
        if not ok:
            return False
    for expr in term.get("matchFields") or []:  # only metadata.name exists
        if (node.name in (expr.get("values") or [])) != (expr["operator"] == "In"):
            return False
    return True


def matches_node(pod: Obj, node: FakeNode) -> bool:
    spec = pod["spec"]
    if any(node.labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    return not required or any(
        _term_matches(t, node) for t in required.get("nodeSelectorTerms") or []
    )


def holds_node(pod: Obj) -> bool:
    """Whether a pod still takes room on its node: bound and not finished."""
    return bool(pod["spec"].get("nodeName")) and pod["status"].get("phase") not in (
        "Succeeded",
        "Failed",
    )


class Scheduler:
    def __init__(self, store: Store, nodes: list[FakeNode]) -> None:
        self.store = store
        self.nodes = {n.name: n for n in nodes}

    def filter(self, pod: Obj, node: FakeNode, used: dict[str, Usage]) -> tuple[list[str], bool]:
        """Why ``pod`` does not fit ``node`` (empty if it does), and whether preemption could
        not help (UnschedulableAndUnresolvable)."""
        tolerations = pod["spec"].get("tolerations") or []
        if node.unschedulable and not tolerates(
            tolerations, {"key": UNSCHEDULABLE, "effect": "NoSchedule"}
        ):
            return ["node(s) were unschedulable"], True
        for taint in node.all_taints():
            if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(
                tolerations, taint
            ):
                return [
                    f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"
                ], True
        if not matches_node(pod, node):
            return ["node(s) didn't match Pod's node affinity/selector"], True
        short = []
        for key, want in requests(pod).items():
            free = parse_quantity(node.allocatable.get(key, "0")) - used[node.name].get(
                key, Fraction(0)
            )
            if want > free:
                short.append("Too many pods" if key == "pods" else f"Insufficient {key}")
        return short, False

    def schedule(self, only: set[str] | None = None) -> None:
        """One pass: bind every pending pod (of those in ``only``, by uid, if given) that fits,
        in priority then creation order; mark the others Unschedulable (a FailedScheduling
        event each). The kubelet calls it when a pod arrives or something frees up."""
        used: dict[str, Usage] = {n: {} for n in self.nodes}
        pending = []
        for pod in self.store.pods.values():
            if holds_node(pod) and pod["spec"]["nodeName"] in used:
                _add(used[pod["spec"]["nodeName"]], requests(pod))
            elif (
                not pod["spec"].get("nodeName")
                and not pod["metadata"].get("deletionTimestamp")
                and pod["spec"].get("schedulerName") == "default-scheduler"
                and (only is None or pod["metadata"]["uid"] in only)
            ):
                pending.append(pod)
        pending.sort(
            key=lambda p: (
                -p["spec"].get("priority", 0),
                p["metadata"]["creationTimestamp"],
                int(p["metadata"]["resourceVersion"]),
            )
        )
        for pod in pending:
            verdicts = {name: self.filter(pod, node, used) for name, node in self.nodes.items()}
            fits = [name for name, (why, _) in verdicts.items() if not why]
            if fits:
                best = max(fits, key=lambda n: (self._room(n, used[n]), n))
                _add(used[best], requests(pod))
                self._bind(pod, best)
            else:
                self._unschedulable(pod, verdicts)

    def _room(self, name: str, used: Usage) -> Fraction:
        alloc = self.nodes[name].allocatable
        return sum(
            (
                (parse_quantity(v) - used.get(k, Fraction(0))) / parse_quantity(v)
                for k, v in alloc.items()
                if parse_quantity(v) > 0
            ),
            Fraction(0),
        )

    def _bind(self, pod: Obj, node: str) -> None:
        meta = pod["metadata"]

        def bind(p: Obj) -> None:
            p["spec"]["nodeName"] = node
            set_condition(p, "PodScheduled", "True")

        bound = self.store.update_pod(meta["namespace"], meta["name"], bind)
        self.store.record_event(
            bound,
            "Scheduled",
            f"Successfully assigned {meta['namespace']}/{meta['name']} to {node}",
            type_="Normal",
        )

    def _unschedulable(self, pod: Obj, verdicts: dict[str, tuple[list[str], bool]]) -> None:
        n = len(verdicts)
        if n == 0:
            message = "no nodes available to schedule pods"
        else:
            reasons = Counter(r for why, _ in verdicts.values() for r in why)
            victims = Counter(
                "Preemption is not helpful for scheduling"
                if hard
                else "No preemption victims found for incoming pod"
                for _, hard in verdicts.values()
            )
            message = (f"0/{n} nodes are available: {', '.join(sorted(f'{c} {r}' for r, c in reasons.items()))}. "
                       f"preemption: 0/{n} nodes are available: {', '.join(sorted(f'{c} {r}' for r, c in victims.items()))}.")  # fmt: skip
        meta = pod["metadata"]
        marked = self.store.update_pod(
            meta["namespace"],
            meta["name"],
            lambda p: set_condition(p, "PodScheduled", "False", "Unschedulable", message),
        )
        self.store.record_event(marked, "FailedScheduling", message)


def set_condition(
    pod: Obj, kind: str, status: str, reason: str | None = None, message: str | None = None
) -> None:
    """Set a pod condition; its lastTransitionTime moves only when its status does."""
    conditions = pod["status"].setdefault("conditions", [])
    old = next((c for c in conditions if c["type"] == kind), None)
    new: Obj = {"type": kind, "status": status, "lastProbeTime": None,
                "lastTransitionTime": old["lastTransitionTime"] if old and old["status"] == status else now()}  # fmt: skip
    if reason:
        new["reason"] = reason
    if message:
        new["message"] = message
    if old is None:
        conditions.append(new)
    else:
        conditions[conditions.index(old)] = new
