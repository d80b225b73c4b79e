"""``GET /metrics``: the gateway's own series in Prometheus' text format, names prefixed
``capyctl_``, written with ``prometheus_client`` from the numbers the hot path keeps
(`Telemetry`) and the state the gateway holds (queues, ledgers, the collector, the lifecycle).
Everything is read at scrape time; every label value comes from the configuration or from the
gateway's fixed vocabularies, never from a client."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from .._deployments.warm import WHYS
from .._gateway import Gateway
from .._lifecycle.states import InstanceState
from .._scheduling.policy import REASONS
from .._tasks import FAULT_KINDS
from .._telemetry import BUCKETS, PHASES, Telemetry

__all__ = ["exposition"]

_LIFECYCLE_STATES = tuple(s.value for s in InstanceState)
_COLLECTOR_STATES = ("connecting", "ready", "failed")


class _GatewayCollector:
    """The families, in their order on the page, each read at scrape time."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    def collect(self) -> Iterator[Metric]:
        gw, t = self.gw, self.gw.telemetry
        yield from _answers(t)
        yield from _slots(gw)
        yield from _settled(t)
        yield from _collector_state(gw)
        yield from _prefix_cache(gw)
        yield from _warm_cache(gw)
        yield from _lifecycle(gw)
        yield from _timings(t)


def _answers(t: Telemetry) -> Iterator[Metric]:
    requests = CounterMetricFamily(
        "capyctl_requests",
        "Requests answered, by outcome.",
        labels=["deployment", "api", "outcome"],
    )
    for (dep, api, outcome), n in sorted(t.requests.items()):
        requests.add_metric([dep, api, outcome], n)
    yield requests
    refusals = CounterMetricFamily(
        "capyctl_refusals",
        "Requests refused, by the documented code.",
        labels=["deployment", "code"],
    )
    for (dep, code), n in sorted(t.refusals.items()):
        refusals.add_metric([dep, code], n)
    yield refusals


def _slots(gw: Gateway) -> Iterator[Metric]:
    """What each deployment's queue and each instance's ledger hold now."""
    running = GaugeMetricFamily(
        "capyctl_running", "Requests holding a running slot.", labels=["deployment"]
    )
    waiting = GaugeMetricFamily(
        "capyctl_waiting", "Requests waiting for a running slot.", labels=["deployment"]
    )
    in_flight = GaugeMetricFamily(
        "capyctl_in_flight",
        "Requests the gateway has at an instance now.",
        labels=["deployment", "instance"],
    )
    cut = GaugeMetricFamily(
        "capyctl_cut_requests",
        "Cut requests still counted against an instance, by how they settle.",
        labels=["deployment", "instance", "settles"],
    )
    for name, route in gw.fleet.routes.items():
        running.add_metric([name], route.queue.running)
        waiting.add_metric([name], route.queue.waiting)
        for inst in route.instances:
            idx = str(inst.index)
            in_flight.add_metric([name, idx], inst.ledger.running)
            rules = {"when_idle": 0, "at_restart": 0}
            for c in inst.ledger.cut:
                rules["when_idle" if c.rule.name == "WHEN_IDLE" else "at_restart"] += 1
            for rule, n in rules.items():
                cut.add_metric([name, idx, rule], n)
    yield from (running, waiting, in_flight, cut)


def _settled(t: Telemetry) -> Iterator[Metric]:
    settled = CounterMetricFamily(
        "capyctl_cut_settled",
        "Cut requests settled, by what settled them.",
        labels=["deployment", "instance", "how"],
    )
    for (dep, idx, how), n in sorted(t.settled.items()):
        settled.add_metric([dep, idx, how], n)
    yield settled


def _collector_state(gw: Gateway) -> Iterator[Metric]:
    state = GaugeMetricFamily(
        "capyctl_collector_state",
        "Where the collector stands with each instance (1 for its state).",
        labels=["deployment", "instance", "state"],
    )
    age = GaugeMetricFamily(
        "capyctl_sample_age_seconds",
        "Age of the instance's latest sample (absent when it has none).",
        labels=["deployment", "instance"],
    )
    fleet = gw.fleet
    collector = fleet.collector
    keys = set(collector.keys())
    now = gw.now()
    for name, route in fleet.routes.items():
        for inst in route.instances:
            if inst.key not in keys:
                continue
            status = collector.status(inst.key)
            idx = str(inst.index)
            for s in _COLLECTOR_STATES:
                state.add_metric([name, idx, s], 1.0 if status.state == s else 0.0)
            if status.latest is not None:
                age.add_metric([name, idx], status.latest.age_s(now))
    yield from (state, age)


def _prefix_cache(gw: Gateway) -> Iterator[Metric]:
    """The engines' own counts, wherever they run (a host's come in its reports)."""
    queried = CounterMetricFamily(
        "capyctl_engine_prefix_cache_queried_tokens",
        "Prompt tokens the engine looked up in its prefix cache, as its own latest sample "
        "counts them since it started (vLLM, llama.cpp).",
        labels=["deployment", "instance"],
    )
    hits = CounterMetricFamily(
        "capyctl_engine_prefix_cache_hit_tokens",
        "Of those, the tokens the engine found cached.",
        labels=["deployment", "instance"],
    )
    for name, route in gw.fleet.routes.items():
        for inst in route.instances:
            counts = inst.runner.prefix_cache()
            if counts is not None:
                queried.add_metric([name, str(inst.index)], counts.queried_tokens)
                hits.add_metric([name, str(inst.index)], counts.hit_tokens)
    yield from (queried, hits)


def _warm_cache(gw: Gateway) -> Iterator[Metric]:
    """What each instance's warm cache saved, restored and failed to, since the gateway
    started, and what it holds on disk (instances whose runner keeps one)."""
    labels = ["deployment", "instance"]
    saves = CounterMetricFamily(
        "capyctl_warm_cache_saves", "Prefixes (engine slots) saved before a stop.", labels=labels
    )
    restores = CounterMetricFamily(
        "capyctl_warm_cache_restores", "Prefixes restored after a start.", labels=labels
    )
    moved = CounterMetricFamily(
        "capyctl_warm_cache_bytes",
        "Bytes of saved caches written (save) and read back (restore).",
        labels=[*labels, "op"],
    )
    failures = CounterMetricFamily(
        "capyctl_warm_cache_failures",
        "Saves and restores that did not happen, by why (the instance served cold).",
        labels=[*labels, "op", "why"],
    )
    disk = GaugeMetricFamily(
        "capyctl_warm_cache_disk_bytes", "What the saved caches hold on disk.", labels=labels
    )
    for name, route in gw.fleet.routes.items():
        for inst in route.instances:
            warm = inst.runner.describe().warm
            if warm is None or not warm.on:
                continue
            row, c = [name, str(inst.index)], warm.counts
            saves.add_metric(row, c.saves)
            restores.add_metric(row, c.restores)
            moved.add_metric([*row, "save"], c.saved_bytes)
            moved.add_metric([*row, "restore"], c.restored_bytes)
            for op in ("save", "restore"):
                for why in WHYS:
                    failures.add_metric([*row, op, why], c.failures.get((op, why), 0))
            disk.add_metric(row, warm.disk_bytes)
    yield from (saves, restores, moved, failures, disk)


def _lifecycle(gw: Gateway) -> Iterator[Metric]:
    state = GaugeMetricFamily(
        "capyctl_lifecycle_state",
        "The state of each instance the gateway runs (1 for its state).",
        labels=["deployment", "instance", "state"],
    )
    for name, life in gw.fleet.lifecycle.lives.items():
        for lc in life.launched:
            for s in _LIFECYCLE_STATES:
                state.add_metric([name, str(lc.inst.index), s], 1.0 if lc.state == s else 0.0)
    yield state
    moves = CounterMetricFamily(
        "capyctl_lifecycle_transitions",
        "Lifecycle transitions of the instances the gateway runs, by the state entered.",
        labels=["deployment", "to"],
    )
    for (dep, to), n in sorted(gw.telemetry.transitions.items()):
        moves.add_metric([dep, to], n)
    yield moves
    faults = CounterMetricFamily(
        "capyctl_task_faults",
        "Defects in the gateway's background tasks (logged with their tracebacks), by task.",
        labels=["task"],
    )
    for kind in FAULT_KINDS:  # a count, not a sample: none seen is a measured 0
        faults.add_metric([kind], gw.fleet.tasks.faults[kind])
    yield faults
    yield from _scheduling(gw)
    held = GaugeMetricFamily(
        "capyctl_memory_held_bytes", "Memory held by launched deployments (their memory:)."
    )
    held.add_metric([], gw.fleet.lifecycle.budget.held())
    yield held
    budget = gw.config.resources.memory_budget
    if budget is not None:
        yield GaugeMetricFamily(
            "capyctl_memory_budget_bytes", "resources.memory_budget.", value=budget
        )


def _timings(t: Telemetry) -> Iterator[Metric]:
    """One histogram per phase; an instance's series appear once it has an observation."""
    for phase in PHASES:
        h = HistogramMetricFamily(
            f"capyctl_{phase}_seconds",
            f"Seconds of {phase.replace('_', ' ')}, counted from the request's arrival "
            "(waits: their own length).",
            labels=["deployment", "instance"],
        )
        at = PHASES.index(phase)
        for (dep, idx), group in sorted(t.timings.items()):
            hist = group[at]
            if not hist.total and not any(hist.counts):
                continue
            cumulative, buckets = 0, []
            for bound, n in zip((*BUCKETS, float("inf")), hist.counts, strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            h.add_metric([dep, idx], buckets, hist.total)
        yield h


def exposition(gateway: Gateway) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_GatewayCollector(gateway))
    return generate_latest(registry)


def _scheduling(gw: Gateway) -> Iterator[Metric]:
    """The scheduler's switches by reason, and the seconds each deployment spent starting,
    waking, parking, stopping and draining."""
    scheduler = gw.fleet.lifecycle.scheduler
    switches = CounterMetricFamily(
        "capyctl_switches",
        "Deployments switched out to make room for another, by the scheduler's reason.",
        labels=["reason"],
    )
    for reason in REASONS:  # a count, not a sample: none seen is a measured 0
        switches.add_metric([reason], scheduler.switches[reason])
    yield switches
    spent = CounterMetricFamily(
        "capyctl_lifecycle_seconds",
        "Seconds the instances of each deployment spent in a transition (starting, waking, "
        "parking, stopping) or draining before one.",
        labels=["deployment", "phase"],
    )
    for (dep, phase), seconds in sorted(scheduler.costs.spent.items()):
        spent.add_metric([dep, phase], seconds)
    yield spent
