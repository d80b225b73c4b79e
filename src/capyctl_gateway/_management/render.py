"""``capyctl-gateway status deployment`` as text: a line for the deployment, a table of its
instances, and the cut requests each still counts. Nothing is cut short: a URL or a request ID
is printed whole however narrow the terminal, and when the output is piped."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

__all__ = ["acted", "print_list", "print_status", "size"]


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def print_status(console: Console, doc: dict[str, Any]) -> None:
    """``status deployment``: the deployment's lines, a table of its instances, each instance's
    address and state, then the cancelled requests each still counts."""
    _print_deployment(console, doc["deployment"])
    rows = doc["instances"]
    console.print(_instance_table(rows))
    # Addresses and reasons on lines of their own: a table column would cut them short.
    for i in rows:
        _print_instance(console, i)
    for i in rows:
        _print_cancelled(console, i)


def _print_deployment(console: Console, d: dict[str, Any]) -> None:
    """The deployment's line, then its lifecycle and park where the gateway launched it."""
    console.print(
        f"{d['name']} ({d['id']}): api {d['api']}, {d['engine']} {d['engine_version']} "
        f"({d['served_model']}), {d['state']}; "
        f"gateway running {d['running']}, waiting {d['waiting']}",
        soft_wrap=True,
    )
    if "lifecycle" in d:
        held = d.get("memory_held")
        console.print(
            f"launched by the gateway: {d['lifecycle']}; "
            + ("a park is a stop" if d["park"] == "stop" else f"a park keeps it up ({d['park']})")
            + ("" if held is None else f"; memory held {size(held)}"),
            soft_wrap=True,
        )


def _instance_table(rows: list[dict[str, Any]]) -> Table:
    table = Table("instance", "state", "running", "waiting", "snapshot age")
    for i in rows:
        age = i["snapshot_age_s"]
        table.add_row(
            str(i["index"]),
            _state(i),
            _cell(i["running"]),
            _cell(i["waiting"]),
            "-" if age is None else f"{age:.1f} s",
        )
    return table


def _state(i: dict[str, Any]) -> str:
    """An instance's state as watched, its lifecycle's where that differs (a parked engine
    still answers), and whether it is a spare."""
    lifecycle = i.get("lifecycle", i["state"])
    state = i["state"] if lifecycle == i["state"] else f"{i['state']} ({lifecycle})"
    return state + _spare(i)


def _spare(i: dict[str, Any]) -> str:
    """What follows an instance's state where it is a spare (as the console writes it too)."""
    return ", a spare" if i.get("spare") else ""


def _print_instance(console: Console, i: dict[str, Any]) -> None:
    """An instance's address and where it runs, then its error, lifecycle and process."""
    where = i["url"] if i["url"] is not None else "not running"
    about = f"host {i['host']}" if "session" in i else f"machine {i['machine']}"
    if "session" in i:
        report = i.get("report_age_s")
        about += f", session {i['session']}" + (
            ""
            if report is None
            else f", reported {report:.1f} s ago, ingress in flight {i.get('ingress_in_flight')}"
        )
    console.print(f"instance {i['index']}: {where} ({about})", soft_wrap=True)
    if i.get("error"):
        console.print(f"  error: {i['error']}", soft_wrap=True)
    if i.get("not_routed"):
        console.print(f"  not routed: {i['not_routed']}", soft_wrap=True)
    if "lifecycle" in i:
        console.print(f"  {i['lifecycle']}{_spare(i)}", soft_wrap=True)
    for line in i.get("shown", ()):
        console.print(f"  {line['text']}", soft_wrap=True)
    if "process" in i:
        proc = i["process"]
        keeper = f" (its reaper: {proc['reaper_pid']})" if proc.get("reaper_pid") else ""
        console.print(
            f"  pid {proc['pid']}{keeper}, port {proc['port']}: {' '.join(proc['command'])}",
            soft_wrap=True,
        )


def _print_cancelled(console: Console, i: dict[str, Any]) -> None:
    """The cancelled requests an instance still counts, one a line."""
    cut = i["cancelled"]
    if not cut:
        console.print(f"instance {i['index']}: no cancelled requests counted")
        return
    console.print(
        f"instance {i['index']}: {len(cut)} cancelled request(s) still counted", soft_wrap=True
    )
    for c in cut:
        console.print(
            f"  {c['capyctl_request_id']} ({c['reason']}): settles {c['settles']}",
            soft_wrap=True,
        )


def print_list(console: Console, doc: dict[str, Any]) -> None:
    """``capyctl-gateway list``: a table of every deployment, then the memory budget. Where
    the table would not fit the terminal whole (80 columns and a model ID as the name), each
    deployment is printed as two lines instead: a column too narrow cut every word short."""
    table = _list_table(doc["deployments"])
    whole = Measurement.get(console, console.options.update_width(10_000), table).maximum
    if whole <= console.width:
        console.print(table)
    else:
        for d in doc["deployments"]:
            what = f"api {d['api']}, engine {d['engine']}, run by {d['run_by']}"
            console.print(f"{d['name']} ({d['id']}): {what}", soft_wrap=True)
            held = "" if d.get("memory_held") is None else f"; memory held {_held(d)}"
            ready = f"{d['ready']}/{d['instances']} instances ready"
            console.print(f"  {d['state']}; {ready}{held}", soft_wrap=True)
    _list_notes(console, doc)


def _held(d: dict[str, Any]) -> str:
    return "—" if d.get("memory_held") is None else size(d["memory_held"])


def _list_table(rows: list[dict[str, Any]]) -> Table:
    table = Table()
    # The name, the ID and the engine whole, however narrow the terminal: the others give way.
    longest = max((len(d["name"]) for d in rows), default=10)
    table.add_column("deployment", no_wrap=True, min_width=longest)
    table.add_column("id", no_wrap=True, min_width=12)
    table.add_column("api")
    engines = max((len(d["engine"]) for d in rows), default=6)
    table.add_column("engine", no_wrap=True, min_width=engines)  # a cut name says nothing
    for title in ("run by", "state", "ready", "memory held"):
        table.add_column(title)
    for d in rows:
        table.add_row(
            d["name"],
            d["id"],
            d["api"],
            d["engine"],
            d["run_by"],
            d["state"],
            f"{d['ready']}/{d['instances']}",
            _held(d),
        )
    return table


def _list_notes(console: Console, doc: dict[str, Any]) -> None:
    """What ``list`` prints under its deployments: hosts, where each runs (a pod, its node), and
    the memory budget (where
    something counts memory: a budget, or a deployment with ``memory:``)."""
    for d in doc["deployments"]:
        for h in d.get("hosts", []):
            age = h["sample_age_s"]
            console.print(
                f"{d['name']} instance {h['instance']}: host {h['host']}, session "
                f"{h['session']}, "
                + ("no fresh sample" if age is None else f"sample {age:.1f} s old"),
                soft_wrap=True,
            )
        for p in d.get("placed", []):
            console.print(f"{d['name']} instance {p['instance']}: {p['where']}", soft_wrap=True)
    for pool in doc.get("pools", []):
        _pool_schedule(console, pool)
    budget = doc["memory_budget"]
    if budget is None and all(d.get("memory_held") is None for d in doc["deployments"]):
        return  # nothing counts memory (no budget, no `memory:`): no figure, not a zero
    console.print(
        f"memory held by launched deployments: {size(doc['memory_held'])}"
        + ("" if budget is None else f" of a budget of {size(budget)}")
        + (
            " (OVER BUDGET: an engine's stop was not confirmed; its memory stays counted)"
            if doc.get("over_budget")
            else ""
        ),
        soft_wrap=True,
    )


def _pool_schedule(console: Console, pool: dict[str, Any]) -> None:
    """What the scheduler does in ``pool``: what waits to be switched in, and its next switch."""
    for w in pool.get("waiting", []):
        console.print(
            f"{pool['pool']}: deployment {w['name']} waits to be switched in "
            f"({w['requests']} requests, the oldest for {w['oldest_s']:.1f} s)",
            soft_wrap=True,
        )
    if (nxt := pool.get("next_switch")) is not None:
        when = "once it has nothing to do" if nxt["in_s"] is None else f"within {nxt['in_s']:.1f} s"
        console.print(
            f"{pool['pool']}: next switch: {nxt['out']} out, {nxt['in']} in, {when} ({nxt['why']})",
            soft_wrap=True,
        )


def size(n: int) -> str:
    """``n`` bytes as an operator writes sizes in the configuration: 4 GiB, 1.5 GiB, 512 MiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n} B"


def acted(action: str, doc: dict[str, Any]) -> str:
    """What ``start``, ``stop`` or ``park`` prints of the deployment it answered with: its
    lifecycle state, and for a park that had to stop the engine, that it is parked all the
    same (the next request starts it)."""
    d = doc["deployment"]
    state = str(d.get("lifecycle", d["state"]))
    if action == "park" and state == "stopped":
        return "parked (stopped: it cannot sleep here); the next request starts it"
    return state
