"""The figures of one run, the tables of a whole benchmark, and its goals (issue 44): in ``i``,
``cost_aware`` makes at least 3x fewer engine starts (or wakes) per request and answers at
least 2x the requests per minute of ``on_arrival``, and beats ``collate`` on both; in ``iii``,
the trickle's longest wait is within ``resources.max_switch_wait`` plus one switch; no request
is lost anywhere."""

from __future__ import annotations

import math
import statistics
from typing import Any

from .gateway import Listed, Sample, by_label, delta
from .load import Sent

__all__ = ["figures", "goals", "tables"]

PHASES = ("starting", "waking", "parking", "stopping", "draining")
POLICIES = ("on_arrival", "collate", "cost_aware")
MAX_SWITCH_WAIT_S = 30.0
"""``resources.max_switch_wait``: the default, which every run keeps."""


def _pct(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(math.ceil(q * len(ordered)) - 1, 0)], 2)


def figures(
    sent: list[Sent],
    started: int,
    elapsed_s: float,
    before: Sample,
    after: Sample,
    listed: Listed,
    names: tuple[str, ...],
    fits: int,
) -> dict[str, Any]:
    """``fits``: how many engines the budget holds at once; the share of time spent switching
    is of their time together (the window times ``fits``)."""
    d = delta(before, after)
    answered = [s for s in sent if s.total_s is not None]
    moves = by_label(d, "capyctl_lifecycle_transitions_total", "to")
    phases = by_label(d, "capyctl_lifecycle_seconds_total", "phase")
    activations = moves.get("starting", 0.0) + moves.get("waking", 0.0)
    per: dict[str, Any] = {}
    for name in names:
        mine = [s for s in answered if s.deployment == name]
        waits = [s.wait_s for s in mine if s.wait_s is not None]
        gens = [s.total_s - s.wait_s for s in mine if s.total_s is not None and s.wait_s]
        per[name] = {
            "answered": len(mine),
            "wait_p50_s": _pct(waits, 0.50),
            "wait_p95_s": _pct(waits, 0.95),
            "wait_max_s": _pct(waits, 1.0),
            "generation_mean_s": round(statistics.fmean(gens), 2) if gens else None,
            "generation_max_s": round(max(gens), 2) if gens else None,
        }
    spent = sum(phases.get(p, 0.0) for p in PHASES)
    return {
        "window_s": round(elapsed_s, 1),
        "sent": started,
        "answered": len(answered),
        "lost": started - len(answered),
        "errors": sorted({s.error for s in sent if s.error})[:5],
        "per_minute": round(len(answered) * 60 / elapsed_s, 1) if elapsed_s else None,
        "starts": int(moves.get("starting", 0.0)),
        "wakes": int(moves.get("waking", 0.0)),
        "parks": int(moves.get("parking", 0.0)),
        "stops": int(moves.get("stopping", 0.0)),
        "activations_per_request": round(activations / len(answered), 3) if answered else None,
        "switches": {k: int(v) for k, v in by_label(d, "capyctl_switches_total", "reason").items()},
        "transition_s": {p: round(phases[p], 2) for p in PHASES if p in phases},
        "transition_share": round(spent / (elapsed_s * fits), 3) if elapsed_s else None,
        "deployments": per,
        "listed": listed.row(),
        "requests": [
            [s.deployment, round(s.at_s, 2), _r(s.wait_s), _r(s.total_s), s.status] for s in sent
        ],
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _switch_s(run: dict[str, Any]) -> float:
    """One switch of the run, as it measured them: the longest generation a drain waits for,
    the mean park or stop, the mean wake or start."""
    t, n = run["transition_s"], run
    down = t.get("parking", 0.0) / n["parks"] if n["parks"] else 0.0
    down = max(down, t.get("stopping", 0.0) / n["stops"] if n["stops"] else 0.0)
    up = t.get("waking", 0.0) / n["wakes"] if n["wakes"] else 0.0
    up = max(up, t.get("starting", 0.0) / n["starts"] if n["starts"] else 0.0)
    drain = max((d["generation_max_s"] or 0.0) for d in run["deployments"].values())
    return drain + down + up


def goals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each engine's goals, met or not, with the figures they rest on."""
    out: dict[str, Any] = {}
    for engine in sorted({r["engine"] for r in runs}):
        got = {(r["scenario"], r["policy"]): r for r in runs if r["engine"] == engine}
        mine: dict[str, Any] = {"lost": sum(r["lost"] for r in got.values())}
        mine["nothing_lost"] = mine["lost"] == 0
        if all(("i", p) in got for p in POLICIES):
            old, col, new = (got[("i", p)] for p in POLICIES)
            per = [r["activations_per_request"] or math.inf for r in (old, col, new)]
            rpm = [r["per_minute"] or 0.0 for r in (old, col, new)]
            mine["i_fewer_starts"] = round(per[0] / per[2], 2) if per[2] else None
            mine["i_more_per_minute"] = round(rpm[2] / rpm[0], 2) if rpm[0] else None
            mine["i_ahead_of_collate"] = per[2] < per[1] and rpm[2] > rpm[1]
            mine["i_met"] = (
                (mine["i_fewer_starts"] or 0) >= 3
                and (mine["i_more_per_minute"] or 0) >= 2
                and mine["i_ahead_of_collate"]
            )
        if ("iii", "cost_aware") in got:
            run = got[("iii", "cost_aware")]
            bound = MAX_SWITCH_WAIT_S + _switch_s(run)
            worst = run["deployments"]["trickle"]["wait_max_s"]
            mine["iii_trickle_max_wait_s"] = worst
            mine["iii_bound_s"] = round(bound, 2)
            mine["iii_met"] = worst is not None and worst <= bound
        out[engine] = mine
    return out


def tables(runs: list[dict[str, Any]], titles: dict[str, str]) -> str:
    """Markdown: a table per engine and scenario, a row per policy, the waits (p50 / p95 / max,
    seconds) a column per deployment."""
    lines: list[str] = []
    for engine in dict.fromkeys(r["engine"] for r in runs):
        for scenario, title in titles.items():
            rows = [r for r in runs if r["engine"] == engine and r["scenario"] == scenario]
            if not rows:
                continue
            names = list(rows[0]["deployments"])
            lines += ["", f"**{engine}, ({scenario}) {title}**", ""]
            lines.append(
                "| policy | answered/min | starts+wakes per request | switch time share | lost | "
                + " | ".join(f"wait {n} (s)" for n in names)
                + " |"
            )
            lines.append("|---" * (5 + len(names)) + "|")
            for r in sorted(rows, key=lambda r: POLICIES.index(r["policy"])):
                waits = [r["deployments"][n] for n in names]
                cells = [
                    f"{d['wait_p50_s']} / {d['wait_p95_s']} / {d['wait_max_s']}" for d in waits
                ]
                lines.append(
                    f"| {r['policy']} | {r['per_minute']} | {r['activations_per_request']}"
                    f" ({r['starts'] + r['wakes']}/{r['answered']}) "
                    f"| {_share(r['transition_share'])} | {r['lost']} | " + " | ".join(cells) + " |"
                )
    return "\n".join(lines) + "\n"


def _share(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f} %"
