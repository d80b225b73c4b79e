"""The fault soak across machines: a capyctl-gateway server and two hosts, each in its own network
namespace (``contract.live.netns``: made by the run, removed however it ends, traffic only
inside them), a fault-counting engine (``bench.perf.fault_engine``) on each host's loopback as
its ``url:`` instance, and, for ``--duration`` seconds:

* chat requests from the server's namespace (``bench.perf.machines_load load``) with random
  hang-ups in every phase (while the body is sent, queued, before the first token, mid-stream,
  while the engine works);
* a host killed (SIGKILL) and started again, twice (one per host);
* a partition of one host (its link down) and its heal;
* a flood of idle connections on every listener: the server's public, control, management and
  metrics listeners and both ingresses, ``--flood-count`` each, half of them idle from the start,
  half after one answered request (keep-alive), the control port's all idle (it speaks TLS), and
  held up to 20 s.

Then it waits for the server to settle the requests it cut, and reports: every request's outcome
(nothing may be *lost*: a connection closed with no answer, an undocumented status), what each
engine counted (nothing in progress or open there at the end, each request seen once, on one
engine only), the cut requests the server still counts, what became of the flood's connections,
and the processes' open files and RSS before, at their peak and after.

Run as root from the repository root: ``.venv/bin/python -m bench.perf.machines_soak
[--duration 180] [--seed S] [--json FILE] [--keep]``. It prints a markdown report and exits 1
when a request was lost, an engine was left with a request or a connection open, a request
reached an engine twice or both engines, or a cut request the engine had answered stayed
counted (one cut before its first token waits for the engine's next stop or restart).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contract.live.netns import Net, netns_unavailable

from capyctl_gateway._deployments.settle import SettleRule

from ._procfs import rss_kib
from .soak import fd_count

__all__ = ["main"]

HOSTS = ["soak-a", "soak-b"]
GATEWAY = str(Path(sys.executable).parent / "capyctl-gateway")
ENGINE_PORT = 8100
INGRESS_PORT = 8444
CONFIG = """\
deployments:
  - name: bench
    engine: vllm
    engine_version: "0.31.0"
    served_model: tiny
    instances:
      - host: soak-a
        url: http://127.0.0.1:{port}
      - host: soak-b
        url: http://127.0.0.1:{port}
queue:
  request_deadline: 5s
  stream_idle_timeout: 2s
  max_running_per_deployment: 16
  max_waiting_per_deployment: 256
  max_waiting_total: 256
"""
GET = (
    "import sys, urllib.request; "
    "print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
)


class Soak:
    def __init__(self, net: Net, work: Path) -> None:
        self.net, self.work = net, work
        self.state = work / "state-server"
        self.log = work / "server.log"
        self.hosts: dict[str, subprocess.Popen[bytes]] = {}
        self.server: subprocess.Popen[bytes] | None = None
        self.timeline: list[tuple[float, str]] = []
        self.t0 = time.monotonic()

    def note(self, what: str) -> None:
        at = round(time.monotonic() - self.t0, 1)
        self.timeline.append((at, what))
        print(f"[{at:6.1f} s] {what}", file=sys.stderr, flush=True)

    # -- processes --------------------------------------------------------------------------
    def start(self) -> None:
        (self.work / "server.yaml").write_text(CONFIG.format(port=ENGINE_PORT))
        for name, m in self.net.hosts.items():
            argv = [sys.executable, "-m", "bench.perf.fault_engine", "--host", "127.0.0.1",
                    "--port", str(ENGINE_PORT), "--served", "tiny"]  # fmt: skip
            self.net.popen(m, argv, log=self.work / f"engine-{name}.log")
        addr = self.net.server.address
        self.server = self.net.popen(self.net.server, [GATEWAY, "serve", "--role", "server",
            "--config", str(self.work / "server.yaml"), "--listen", f"{addr}:8443",
            "--control", f"{addr}:7445", "--metrics", f"{addr}:9464", "--state-dir",
            str(self.state), "--log-format", "json"], log=self.log)  # fmt: skip
        self.wait(lambda: "capyctl-gateway listening" in self._text(self.log), "the server")
        for name in HOSTS:
            join = self.work / f"{name}.join"
            r = self.net.run(self.net.server, [GATEWAY, "invite", "host", name, "--output",
                             str(join), "--state-dir", str(self.state)])  # fmt: skip
            assert r.returncode == 0, r.stderr
            state = self.work / f"state-{name}"
            r = self.net.run(self.net.hosts[name], [GATEWAY, "host", "join", "--join-file",
                             str(join), "--state-dir", str(state)])  # fmt: skip
            assert r.returncode == 0, r.stderr
            self.serve_host(name)
        self.wait(lambda: self.ready() == 2, "both instances ready", within=60)

    def serve_host(self, name: str) -> None:
        m = self.net.hosts[name]
        state = self.work / f"state-{name}"
        argv = [GATEWAY, "host", "serve", "--ingress", f"{m.address}:{INGRESS_PORT}",
                "--state-dir", str(state), "--log-format", "json"]  # fmt: skip
        self.hosts[name] = self.net.popen(m, argv, log=self.work / f"{name}.log")

    @staticmethod
    def _text(path: Path) -> str:
        try:
            return path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @staticmethod
    def wait(check: Callable[[], bool], what: str, within: float = 30) -> None:
        end = time.monotonic() + within
        while not check():
            if time.monotonic() > end:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.2)

    def status(self) -> dict[str, Any]:
        r = self.net.run(self.net.server, [GATEWAY, "status", "deployment", "bench", "--json",
                         "--state-dir", str(self.state)])  # fmt: skip
        if r.returncode != 0:
            return {}
        doc: dict[str, Any] = json.loads(r.stdout)
        return doc

    def ready(self) -> int:
        inst = self.status().get("instances", [])
        return sum(1 for i in inst if i.get("session") == "live" and i.get("state") == "ready")

    def engine(self, name: str, path: str) -> dict[str, Any]:
        url = f"http://127.0.0.1:{ENGINE_PORT}{path}"
        r = self.net.run(self.net.hosts[name], [sys.executable, "-c", GET, url])
        doc: dict[str, Any] = json.loads(r.stdout)
        return doc

    def pids(self) -> dict[str, int]:
        out = {"server": self.server.pid} if self.server is not None else {}
        out.update({n: p.pid for n, p in self.hosts.items() if p.returncode is None})
        return out


def _sample(soak: Soak, peaks: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    now: dict[str, dict[str, float]] = {}
    for name, pid in soak.pids().items():
        fds, rss = fd_count(pid), rss_kib(pid)
        if fds is None or rss is None:
            continue
        now[name] = {"fds": fds, "rss_mib": round(rss / 1024, 1)}
        peak = peaks.setdefault(name, {"fds": 0, "rss_mib": 0.0})
        peak["fds"] = max(peak["fds"], fds)
        peak["rss_mib"] = max(peak["rss_mib"], now[name]["rss_mib"])
    return now


def _cut(status: dict[str, Any]) -> dict[str, Any]:
    cut = [c for i in status.get("instances", []) for c in i.get("cancelled", [])]
    return {
        "counted": len(cut),
        "answered_counted": sum(c.get("settles") == SettleRule.WHEN_IDLE.value for c in cut),
        "by_reason": dict(Counter(str(c.get("reason")) for c in cut)),
        "by_settle_rule": dict(Counter(str(c.get("settles")) for c in cut)),
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    with Net(HOSTS) as net:
        soak = Soak(net, work)
        soak.start()
        soak.note("server and both hosts up, both instances ready")
        peaks: dict[str, dict[str, float]] = {}
        before = _sample(soak, peaks)
        d = args.duration
        creds = soak.state / "identity" / "server-credentials.json"
        load = net.popen(net.server, [sys.executable, "-m", "bench.perf.machines_load", "load",
            "--host", net.server.address, "--key-file", str(creds), "--duration", str(d),
            "--concurrency", str(args.concurrency), "--seed", str(args.seed),
            "--out", str(work / "load.json")], log=work / "load.log")  # fmt: skip
        t_load = time.monotonic()
        addr = net.server.address
        ingress = {n: f"{m.address}:{INGRESS_PORT}" for n, m in net.hosts.items()}
        half = args.flood_count // 2
        targets = [
            *(f"public-{k}={addr}:8443:{k}" for k in ("idle", "keepalive")),
            *(f"management-{k}=127.0.0.1:7443:{k}" for k in ("idle", "keepalive")),
            *(f"metrics-{k}={addr}:9464:{k}" for k in ("idle", "keepalive")),
            *(f"ingress-{n}-{k}={a}:{k}" for n, a in ingress.items()
              for k in ("idle", "keepalive")),
        ]  # fmt: skip
        floods: list[subprocess.Popen[bytes]] = []
        schedule: list[tuple[float, str, Callable[[], object]]] = [
            (0.14 * d, "kill host soak-a", lambda: net.kill(soak.hosts["soak-a"])),
            (0.22 * d, "start host soak-a again", lambda: soak.serve_host("soak-a")),
            (0.39 * d, "partition soak-b (link down)", lambda: net.link_down("soak-b")),
            (0.47 * d, "heal soak-b (link up)", lambda: net.link_up("soak-b")),
            (0.61 * d, "flood every listener", lambda: floods.extend([
                net.popen(net.server, [sys.executable, "-m", "bench.perf.machines_load",
                    "flood", *(x for t in targets for x in ("--target", t)), "--count",
                    str(half), "--hold", "20", "--out", str(work / "flood.json")],
                    log=work / "flood.log"),
                net.popen(net.server, [sys.executable, "-m", "bench.perf.machines_load",
                    "flood", "--target", f"control-idle={addr}:7445:idle", "--count",
                    str(args.flood_count), "--hold", "20", "--out",
                    str(work / "flood-control.json")], log=work / "flood-control.log"),
                # Past the ingress's cap (1,024): idle connects, on top of the ones above.
                net.popen(net.server, [sys.executable, "-m", "bench.perf.machines_load",
                    "flood", "--target", f"ingress-soak-a-past-cap={ingress['soak-a']}:idle",
                    "--count", str(args.past_cap_count), "--hold", "20", "--out",
                    str(work / "flood-past-cap.json")], log=work / "flood-past-cap.log"),
            ])),
            (0.81 * d, "kill host soak-b", lambda: net.kill(soak.hosts["soak-b"])),
            (0.86 * d, "start host soak-b again", lambda: soak.serve_host("soak-b")),
        ]  # fmt: skip
        during: list[dict[str, Any]] = []
        while load.poll() is None:
            elapsed = time.monotonic() - t_load
            while schedule and schedule[0][0] <= elapsed:
                _, what, act = schedule.pop(0)
                soak.note(what)
                act()
            now = _sample(soak, peaks)
            if floods and any(f.poll() is None for f in floods):
                during.append(now)
            time.sleep(0.5)  # the sampling period, and the fault schedule's resolution
        soak.note(f"load done (exit {load.returncode})")
        for f in floods:
            f.wait(60)
        right_after = _cut(soak.status())
        # Settle: the hosts' engines are url: engines; a cut the engine had answered settles on
        # a report that shows the engine idle; one cut before its first token stays counted
        # until the engine's next stop or restart (the guide's rule), which a url: engine may
        # never have: those are reported, not waited for.
        settle_start = time.monotonic()
        final: dict[str, Any] = {}
        while time.monotonic() - settle_start < args.settle_s:
            final = _cut(soak.status())
            if final.get("answered_counted") == 0:
                break
            time.sleep(0.5)
        settled_s = round(time.monotonic() - settle_start, 1)
        soak.note(f"cut requests still counted: {final.get('counted')} after {settled_s} s")
        # The engines' pooled connections from their ingress expire (kept idle 4 s).
        engines: dict[str, Any] = {}
        end = time.monotonic() + 20
        while True:
            engines = {n: soak.engine(n, "/debug/counts") for n in HOSTS}
            if all(e["open_chat_connections"] == 0 for e in engines.values()):
                break
            if time.monotonic() > end:
                break
            time.sleep(0.5)
        requests = {n: soak.engine(n, "/debug/requests")["requests"] for n in HOSTS}
        after = _sample(soak, {})
        status = soak.status()
        log_text = soak._text(soak.log)
        return {
            "seed": args.seed,
            "duration_s": d,
            "timeline": soak.timeline,
            "load": json.loads((work / "load.json").read_text()),
            "flood": {
                **json.loads((work / "flood.json").read_text()),
                **json.loads((work / "flood-control.json").read_text()),
                **json.loads((work / "flood-past-cap.json").read_text()),
            },
            "engines": engines,
            "engine_requests": requests,
            "cut_right_after": right_after,
            "cut_final": final,
            "settled_s": settled_s,
            "procs": {"before": before, "peak": peaks, "after": after},
            "during_flood_max": {
                n: max((s[n]["fds"] for s in during if n in s), default=None)
                for n in ["server", *HOSTS]
            },
            "status_after": status,
            "log_lines": {
                "server: the control port full": log_text.count("the control port holds its"),
                "server: host sessions lost": log_text.count('"state":"lost"'),
                **{
                    f"{n}: the ingress full": soak._text(work / f"{n}.log").count("holds its")
                    for n in HOSTS
                },
            },
        }


def analyse(doc: dict[str, Any]) -> dict[str, Any]:
    rows = doc["load"]["results"]
    by_cat = Counter(r["category"] for r in rows)
    seen: dict[str, list[tuple[str, Any]]] = {}
    for host, reqs in doc["engine_requests"].items():
        for rid, (_mode, end) in reqs.items():
            seen.setdefault(rid, []).append((host, end))
    served_not_finished = [
        r["rid"] for r in rows
        if r["category"] == "served"
        and [e for _, e in seen.get(str(r["rid"]), [])] != ["finished"]
    ]  # fmt: skip
    errors = [r for r in rows if r["category"] in ("http_error", "inband_error")]
    never_saw = [r for r in errors if str(r["rid"]) not in seen]
    hung = [r for r in rows if r["category"] == "hung_up"]
    engines = doc["engines"]
    return {
        "requests": len(rows),
        "by_category": dict(by_cat),
        "lost": [r for r in rows if r["category"] == "lost"],
        "by_label": dict(Counter(r["label"] for r in rows).most_common()),
        "by_kind": dict(Counter(r["kind"] for r in rows).most_common()),
        "reached_an_engine": len(seen),
        "reached_both_engines": [rid for rid, s in seen.items() if len(s) > 1],
        "still_open_at_an_engine": [rid for rid, s in seen.items() if any(e is None for _, e in s)],
        "served_not_finished_at_one_engine": served_not_finished,
        "errors_the_engine_never_saw": len(never_saw),
        "errors_by_label": dict(Counter(r["label"] for r in errors)),
        "hung_up_never_at_engine": sum(1 for r in hung if str(r["rid"]) not in seen),
        "hung_up_at_engine_by_end": dict(
            Counter(str(seen[str(r["rid"])][0][1]) for r in hung if str(r["rid"]) in seen)
        ),
        "engine_in_progress": {n: e["in_progress"] for n, e in engines.items()},
        "engine_open_chat_connections": {n: e["open_chat_connections"] for n, e in engines.items()},
        "engine_duplicates": {n: e["duplicates"] for n, e in engines.items()},
    }


def verdict(a: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    bad = []
    if a["lost"]:
        bad.append(f"{len(a['lost'])} requests lost")
    if a["reached_both_engines"] or any(a["engine_duplicates"].values()):
        bad.append("a request reached an engine twice, or both engines")
    if a["still_open_at_an_engine"] or any(a["engine_in_progress"].values()):
        bad.append("a request is still in progress at an engine")
    if any(a["engine_open_chat_connections"].values()):
        bad.append("an engine connection that carried a chat request is still open")
    if a["served_not_finished_at_one_engine"]:
        bad.append("a served request did not finish at exactly one engine")
    if doc["cut_final"].get("answered_counted") != 0:
        bad.append(f"answered cut requests still counted: {doc['cut_final']}")
    return bad


def markdown(doc: dict[str, Any], a: dict[str, Any], bad: list[str]) -> str:
    lines = [
        f"# Fault soak across machines (seed {doc['seed']}, {doc['duration_s']:g} s of load)",
        "",
        "## Timeline",
        "",
        *(f"- {at:.1f} s: {what}" for at, what in doc["timeline"]),
        "",
        "## Requests",
        "",
        f"- requests: {a['requests']}; by category: {a['by_category']}",
        f"- lost: {len(a['lost'])} {[(r['rid'], r['kind'], r['detail']) for r in a['lost'][:10]]}",
        f"- outcomes: {a['by_label']}",
        f"- plans: {a['by_kind']}",
        f"- reached an engine: {a['reached_an_engine']}; reached both engines or one twice: "
        f"{a['reached_both_engines']} / {a['engine_duplicates']}",
        f"- documented errors: {a['errors_by_label']}; of them the engine never saw "
        f"{a['errors_the_engine_never_saw']}",
        f"- hung up: never at an engine {a['hung_up_never_at_engine']}; at an engine, how they "
        f"ended there: {a['hung_up_at_engine_by_end']}",
        "- served but not finished at exactly one engine: "
        f"{a['served_not_finished_at_one_engine']}",
        f"- at the end, engines in progress {a['engine_in_progress']}, open chat connections "
        f"{a['engine_open_chat_connections']}",
        f"- engines' counts: {json.dumps(doc['engines'])}",
        f"- cut requests the server counts: right after the load {doc['cut_right_after']}; "
        f"{doc['settled_s']} s later {doc['cut_final']}",
        "",
        "## Listeners under the flood",
        "",
        *(f"- {name}: {json.dumps(f)}" for name, f in doc["flood"].items()),
        f"- open files during the flood, at most: {doc['during_flood_max']}",
        f"- log lines (at most one a second each): {doc['log_lines']}",
        "",
        "## Processes (open files, RSS MiB)",
        "",
        f"- before: {doc['procs']['before']}",
        f"- peak: {doc['procs']['peak']}",
        f"- after: {doc['procs']['after']}",
        "",
        f"**{'FAILED: ' + '; '.join(bad) if bad else 'ok'}**",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.machines_soak", description=__doc__)
    p.add_argument("--duration", type=float, default=180.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--flood-count", type=int, default=300, help="per listener")
    p.add_argument("--past-cap-count", type=int, default=900, help="more, to soak-a's ingress")
    p.add_argument("--settle-s", type=float, default=60.0)
    p.add_argument("--json", default=None)
    p.add_argument("--keep", action="store_true", help="keep the processes' logs")
    args = p.parse_args(argv)
    why = netns_unavailable()
    if why is not None:
        print(f"network namespaces are unavailable here: {why}", file=sys.stderr)
        return 2
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**31)
    print(f"seed {args.seed}", file=sys.stderr, flush=True)
    work = Path(tempfile.mkdtemp(prefix="machines-soak-"))
    ok = False
    try:
        doc = run(args, work)
        a = analyse(doc)
        bad = verdict(a, doc)
        ok = not bad
        sys.stdout.write(markdown(doc, a, bad))
        if args.json:
            Path(args.json).write_text(json.dumps({**doc, "analysis": a, "failures": bad}))
    finally:
        if args.keep or not ok:
            print(f"logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
