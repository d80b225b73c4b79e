"""Folding the rounds into medians, paired ratios and the budget verdicts; the markdown tables."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from ._loads import Measure

__all__ = ["DISPLAY", "SCENARIOS", "markdown", "summarize", "write_json"]

Round = Mapping[str, Mapping[str, Measure]]  # scenario -> target -> measure

SCENARIOS = {
    "ns": "non-streamed, 32 conc.",
    "s16": "16-chunk streams, 32 conc.",
    "s256": "256-chunk streams, 32 conc.",
    "ttft": "added TTFT, conc. 1",
}
DISPLAY = {"direct": "direct to the engine", "gateway": "capyctl-gateway", "peer": "vllm-router"}
GATEWAY = "gateway"
SCENARIOS_RPS = ("ns", "s16", "s256")
PEER = "peer"


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _paired(rounds: Sequence[Round], fn: Callable[..., float | None], *args: Any) -> float | None:
    """The median over rounds of a figure computed within each round."""
    return _median([fn(r, *args) for r in rounds])


def _get(r: Round, scenario: str, target: str) -> Measure | None:
    return r.get(scenario, {}).get(target)


def _ratio(r: Round, scenario: str, target: str, base: str = "direct") -> float | None:
    m, b = _get(r, scenario, target), _get(r, scenario, base)
    if m is None or b is None or not b.req_per_s:
        return None
    return m.req_per_s / b.req_per_s


def _added_ttft(r: Round, target: str) -> float | None:
    m, b = _get(r, "ttft", target), _get(r, "ttft", "direct")
    if m is None or b is None or m.ttft_p50_ms is None or b.ttft_p50_ms is None:
        return None
    return m.ttft_p50_ms - b.ttft_p50_ms


def _extra_chunk_us(r: Round, target: str, long: int, short: int) -> float | None:
    a, b = _get(r, "s256", target), _get(r, "s16", target)
    if a is None or b is None or a.cpu_ms_per_req is None or b.cpu_ms_per_req is None:
        return None
    return (a.cpu_ms_per_req - b.cpu_ms_per_req) * 1000 / (long - short)


def summarize(
    rounds: Sequence[Round], targets: Sequence[str], *, long: int = 256, short: int = 16
) -> dict[str, Any]:
    out: dict[str, Any] = {"targets": {}}
    for t in targets:
        per: dict[str, Any] = {}
        for sc in SCENARIOS:
            ms = [m for r in rounds if (m := _get(r, sc, t)) is not None]
            if not ms:
                continue
            per[sc] = {
                "req_per_s": _median([m.req_per_s for m in ms]),
                "ratio_vs_direct": _paired(rounds, _ratio, sc, t),
                "p50_ms": _median([m.p50_ms for m in ms]),
                "p99_ms": _median([m.p99_ms for m in ms]),
                "ttft_p50_ms": _median([m.ttft_p50_ms for m in ms]),
                "ttft_p99_ms": _median([m.ttft_p99_ms for m in ms]),
                "cpu_ms_per_req": _median([m.cpu_ms_per_req for m in ms]),
                "engine_cpu_ms_per_req": _median(
                    [m.engine_cpu_s * 1000 / m.completed if m.completed else None for m in ms]
                ),
                "completed": sum(m.completed for m in ms),
                "failed": sum(m.failed for m in ms),
                "tool": ms[0].tool,
            }
        per["added_ttft_ms"] = _paired(rounds, _added_ttft, t)
        per["cpu_us_per_extra_chunk"] = _paired(rounds, _extra_chunk_us, t, long, short)
        out["targets"][t] = per
    out["gateway_vs_peer_s16"] = _paired(rounds, _ratio, "s16", GATEWAY, PEER)
    out["gateway_vs_peer_s256"] = _paired(rounds, _ratio, "s256", GATEWAY, PEER)
    for t in targets:
        if t.startswith("gateway-w"):  # a gateway with workers, beside one process and the peer
            out[t] = {
                f"vs_{base}_{sc}": _paired(rounds, _ratio, sc, t, base)
                for base in (GATEWAY, PEER)
                for sc in ("ns", "s16", "s256")
            }
    out["budget"] = _budget(out)
    return out


def _fmt(x: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{unit}"


def _budget(s: dict[str, Any]) -> list[dict[str, Any]]:
    g = s["targets"].get(GATEWAY, {})
    peer = s["targets"].get(PEER)
    rows = []

    def row(scenario: str, budget: str, measured: str, checks: list[bool | None]) -> None:
        verdict = None if any(c is None for c in checks) else all(checks)
        rows.append({"scenario": scenario, "budget": budget, "measured": measured, "met": verdict})

    def le(x: float | None, limit: float) -> bool | None:
        return None if x is None else x <= limit

    def ge(x: float | None, limit: float) -> bool | None:
        return None if x is None else x >= limit

    ns = g.get("ns", {})
    # Issue 16's budget (the rows before it are in docs/performance.md's history).
    row(
        SCENARIOS["ns"],
        ">= 0.10x direct and <= 0.15 ms gateway CPU per request",
        f"{_fmt(ns.get('ratio_vs_direct'), '.3f', 'x')}, "
        f"{_fmt(ns.get('cpu_ms_per_req'), '.3f', ' ms')}",
        [ge(ns.get("ratio_vs_direct"), 0.10), le(ns.get("cpu_ms_per_req"), 0.15)],
    )

    def vs(scenario: str) -> tuple[float | None, str]:
        ratio = s.get(f"gateway_vs_peer_{scenario}")
        peer_rps = peer.get(scenario, {}).get("req_per_s") if peer else None
        mine = g.get(scenario, {}).get("req_per_s")
        return ratio, (
            f"{_fmt(mine, ',.0f')} req/s vs vllm-router {_fmt(peer_rps, ',.0f')} "
            f"({_fmt(ratio, '.2f', 'x')})"
        )

    ratio16, shown16 = vs("s16")
    row(
        SCENARIOS["s16"],
        "at least vllm-router's req/s in the same run",
        shown16,
        [ge(ratio16, 1.0)],
    )
    ratio256, shown256 = vs("s256")
    extra = g.get("cpu_us_per_extra_chunk")
    row(
        SCENARIOS["s256"],
        ">= 1.2x vllm-router's req/s in the same run; <= 2.5 us CPU per extra chunk",
        f"{shown256}; {_fmt(extra, '.1f', ' us')} per extra chunk",
        [ge(ratio256, 1.2), le(extra, 2.5)],
    )
    ttft = g.get("added_ttft_ms")
    row(SCENARIOS["ttft"], "<= 0.3 ms", _fmt(ttft, ".3f", " ms"), [le(ttft, 0.3)])
    return rows


def _verdict(met: bool | None) -> str:
    return {True: "**met**", False: "**not met**", None: "not measured"}[met]


def markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    targets: dict[str, Any] = summary["targets"]
    mach = meta.get("machine", {})
    loads = [mach.get("load_avg_at_start"), mach.get("load_avg_at_end")]
    lines = [
        f"Rounds: {meta['rounds']}, {meta['duration_s']} s per scenario "
        f"({meta['ttft_duration_s']} s for TTFT) after {meta['warmup_s']} s of warm-up; "
        "medians over rounds, ratios paired within a round; non-streamed load by "
        f"{meta['load_tools']['ns']}. Machine: {mach.get('cpu')}, {mach.get('nproc')} CPUs, "
        f"Python {mach.get('python')}; load average at start / end "
        + " / ".join("?" if la is None else f"{la[0]:.2f}" for la in loads)
        + f"; {meta.get('elapsed_s', '?')} s in all.",
        "",
        "| target | " + " | ".join(SCENARIOS.values()) + " | CPU ms per request: ns / s16 / s256"
        " | CPU per extra chunk | peak RSS |",
        "|---" * (len(SCENARIOS) + 4) + "|",
    ]
    for t, per in targets.items():
        cells = [DISPLAY.get(t, t)]
        for sc in ("ns", "s16", "s256"):
            m = per.get(sc)
            if m is None:
                cells.append("–")
            elif t == "direct":
                cells.append(f"{m['req_per_s']:,.0f} req/s")
            else:
                cells.append(
                    f"{_fmt(m['ratio_vs_direct'], '.2f', 'x')} ({m['req_per_s']:,.0f} req/s)"
                )
        if t == "direct":
            d = per.get("ttft", {})
            cells.append(f"– (TTFT {_fmt(d.get('ttft_p50_ms'), '.3f', ' ms')})")
            cpu_key, prefix = "engine_cpu_ms_per_req", "engine: "
        else:
            cells.append(_fmt(per.get("added_ttft_ms"), ".3f", " ms"))
            cpu_key, prefix = "cpu_ms_per_req", ""
        cells.append(
            prefix
            + " / ".join(_fmt(per.get(sc, {}).get(cpu_key), ".3f") for sc in ("ns", "s16", "s256"))
        )
        cells.append(
            "–" if t == "direct" else _fmt(per.get("cpu_us_per_extra_chunk"), ".1f", " µs")
        )
        rss = meta.get("peak_rss_mib", {}).get(t)
        cells.append(_fmt(rss, ".0f", " MiB"))
        lines.append("| " + " | ".join(cells) + " |")
    for t in targets:
        if t.startswith("gateway-w"):
            w = summary[t]
            lines += ["", f"{t}, paired ratios of req/s (ns / s16 / s256):", ""]
            for base in (GATEWAY, PEER):
                ratios = " / ".join(_fmt(w[f"vs_{base}_{sc}"], ".2f", "x") for sc in SCENARIOS_RPS)
                lines.append(f"- against {DISPLAY[base]}: {ratios}")
    lines += ["", "| scenario | budget | measured (gateway) | verdict |", "|---|---|---|---|"]
    lines += [
        f"| {b['scenario']} | {b['budget']} | {b['measured']} | {_verdict(b['met'])} |"
        for b in summary["budget"]
    ]
    lines += [
        "",
        "Latency per request (p50 / p99 ms; streams: whole stream, and time to first content "
        "chunk):",
        "",
        "| target | " + " | ".join(SCENARIOS[sc] for sc in ("ns", "s16", "s256", "ttft")) + " |",
        "|---" * 5 + "|",
    ]
    for t, per in targets.items():
        cells = [DISPLAY.get(t, t)]
        for sc in ("ns", "s16", "s256", "ttft"):
            m = per.get(sc)
            if m is None:
                cells.append("–")
                continue
            cell = f"{_fmt(m['p50_ms'])} / {_fmt(m['p99_ms'])}"
            if m.get("ttft_p50_ms") is not None:
                cell += f"; first chunk {_fmt(m['ttft_p50_ms'], '.3f')} / {_fmt(m['ttft_p99_ms'])}"
            if m["failed"]:
                cell += f" ({m['failed']} failed)"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_json(path: Path, meta: dict[str, Any], summary: Any, rounds: Sequence[Round]) -> None:
    """Every measurement of a run, with its summary and what it ran on, as one JSON document."""
    doc = {
        "meta": meta,
        "summary": summary,
        "rounds": [
            {sc: {name: m.as_dict() for name, m in per.items()} for sc, per in r.items()}
            for r in rounds
        ],
    }
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
