"""Several machines for real: one capyctl-gateway server and two hosts, each a separate process in
its own network namespace (made and removed by the test), with real ``llama-server`` engines
that the hosts launch on the server's orders. Requests come from a client run inside the
server's namespace (`contract.live.ns_client`): no traffic leaves the namespaces.

Waiting for a process's log line polls its log file within a deadline: the processes are
separate, and their logs are what an operator reads too.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from contract.live import gone
from contract.live.netns import Net, netns_unavailable

HOSTS = ["box-a", "box-b"]
GATEWAY = str(Path(sys.executable).parent / "capyctl-gateway")
CLIENT = [sys.executable, "-m", "contract.live.ns_client"]
CALLER = "caller-7f3a9c"


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return []


def wait_for(path: Path, found: Callable[[str], bool], within: float = 30) -> str:
    """The first line of log ``path`` that ``found`` accepts, waiting up to ``within`` s."""
    end = time.monotonic() + within
    while True:
        for line in _lines(path):
            if found(line):
                return line
        if time.monotonic() > end:
            tail = "\n".join(_lines(path)[-20:])
            raise AssertionError(f"not in {path.name} within {within} s; it ends:\n{tail}")
        time.sleep(0.1)


def _settled_lines(cluster: Cluster) -> list[str]:
    return [line for line in _lines(cluster.server_log) if "engine and ingress idle" in line]


def drain(proc: Any, within: float = 180) -> list[str]:
    """What a client printed, once it has exited."""
    out: list[str] = proc.stdout.read().splitlines()
    proc.stdout.close()
    assert proc.wait(within) == 0
    return out


def events(path: Path, name: str) -> list[dict[str, Any]]:
    mark = f'"event":"{name}"'
    return [json.loads(line) for line in _lines(path) if line.startswith("{") and mark in line]


@dataclass
class Cluster:
    net: Net
    tmp: Path
    server_state: Path
    server_log: Path
    key: str = ""
    hosts: dict[str, Any] = field(default_factory=dict)
    """Host name -> its `host serve` process."""

    @property
    def url(self) -> str:
        return f"http://{self.net.server.address}:8443"

    def host_log(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def host_state(self, name: str) -> Path:
        return self.tmp / f"state-{name}"

    def invite(self, name: str) -> Path:
        path = self.tmp / f"{name}-{len(list(self.tmp.glob('*.join')))}.join"
        done = self.net.run(self.net.server, [GATEWAY, "invite", "host", name, "--output",
                            str(path), "--state-dir", str(self.server_state)])  # fmt: skip
        assert done.returncode == 0, done.stderr
        return path

    def join(self, name: str, join_file: Path) -> Any:
        return self.net.run(self.net.hosts[name], [GATEWAY, "host", "join", "--join-file",
                            str(join_file), "--state-dir", str(self.host_state(name))])  # fmt: skip

    def serve_host(self, name: str) -> None:
        machine = self.net.hosts[name]
        argv = [GATEWAY, "host", "serve", "--ingress", f"{machine.address}:8444",
                "--state-dir", str(self.host_state(name)), "--log-format", "json"]  # fmt: skip
        self.hosts[name] = self.net.popen(machine, argv, log=self.host_log(name))

    def sessions(self, name: str, state: str) -> int:
        return sum(
            1 for e in events(self.server_log, "host_session")
            if e.get("host") == name and e.get("state") == state
        )  # fmt: skip

    def chat(self, *args: str, stream: bool = False) -> list[str]:
        argv = [*CLIENT, "chat", "--url", self.url, f"--key={self.key}", *args]
        done = self.net.run(self.net.server, [*argv, *(["--stream"] if stream else [])], 180)
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    def chat_pipe(self, *args: str) -> Any:
        return self.net.pipe(
            self.net.server, [*CLIENT, "chat", "--url", self.url, f"--key={self.key}", *args]
        )

    def status(self) -> dict[str, Any]:
        done = self.net.run(self.net.server, [GATEWAY, "status", "deployment", "tiny", "--json",
                            "--state-dir", str(self.server_state)])  # fmt: skip
        assert done.returncode == 0, done.stderr
        doc: dict[str, Any] = json.loads(done.stdout)
        return doc


@pytest.fixture(scope="module")
def cluster(
    llama_server_binary: Path, llama_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    why = netns_unavailable()
    if why is not None:
        pytest.skip(f"not run: network namespaces are unavailable here: {why}")
    tmp = tmp_path_factory.mktemp("machines")
    os.chmod(tmp, 0o700)
    command = [str(llama_server_binary), "-m", str(llama_models / "tiny.gguf"), "-a", "tiny",
               "-c", "4096", "-t", "1", "--parallel", "2"]  # fmt: skip
    launch = {"command": command, "startup_timeout": "120s"}
    config = {
        "deployments": [{
            "name": "tiny", "engine": "llamacpp", "engine_version": "b10798",
            "instances": [{"host": h, "launch": launch} for h in HOSTS],
        }],
    }  # fmt: skip
    (tmp / "server.yaml").write_text(yaml.safe_dump(config))
    with Net(HOSTS) as net:
        c = Cluster(net, tmp, tmp / "state-server", tmp / "server.log")
        address = net.server.address
        net.popen(net.server, [GATEWAY, "serve", "--role", "server", "--config",
                  str(tmp / "server.yaml"), "--listen", f"{address}:8443", "--control",
                  f"{address}:7445", "--state-dir", str(c.server_state), "--log-format", "json"],
                  log=c.server_log)  # fmt: skip
        wait_for(c.server_log, lambda line: "capyctl-gateway listening" in line)
        creds = c.server_state / "identity" / "server-credentials.json"
        assert creds.stat().st_mode & 0o777 == 0o600
        c.key = json.loads(creds.read_text())["api_key"]
        for name in HOSTS:
            done = c.join(name, c.invite(name))
            assert done.returncode == 0, done.stderr
            c.serve_host(name)
        for name in HOSTS:
            wait_for(c.server_log, lambda _, n=name: c.sessions(n, "live") > 0)  # type: ignore[misc]
        lines = c.chat("--max-tokens", "4")  # starts the deployment: both hosts launch
        assert lines[0] == "HEAD 200", lines
        yield c


def test_requests_spread_over_both_hosts_and_the_callers_id_stays_on_the_server(
    cluster: Cluster,
) -> None:
    # Streams long enough to overlap (the tiny model writes hundreds of tokens a second), so
    # that the server's own in-flight count spreads them.
    clients = [cluster.chat_pipe("--stream", "--max-tokens", "1500", "--caller", CALLER)
               for _ in range(4)]  # fmt: skip
    outputs = [drain(c) for c in clients]
    for out in outputs:
        assert out[0] == "HEAD 200" and out[-2] == "DATA data: [DONE]", out[-3:]
    picks = [e for e in events(cluster.server_log, "router_selection")
             if e.get("caller_request_id") == CALLER]  # fmt: skip
    assert len(picks) == 4
    assert {p["host"] for p in picks} == set(HOSTS)  # load spread them over both machines
    assert all(len(p["candidates"]) + len(p["skipped"]) == 2 for p in picks)
    # The caller's ID: on the server's router lines, nowhere else on the server or the hosts.
    server_other = [line for line in _lines(cluster.server_log)
                    if CALLER in line and '"router_selection"' not in line]  # fmt: skip
    assert server_other == []
    for name in HOSTS:
        logs = [cluster.host_log(name), *(cluster.host_state(name) / "logs").glob("*.log")]
        assert all(CALLER not in p.read_text(errors="replace") for p in logs)


PROMPT_BYTES = 1_100_000
"""Over 1 MB of prompt: some 480,000 tokens for the tiny model, whose slots hold 2,048."""


def test_a_prompt_over_a_megabyte_reaches_the_engine_whole_and_its_refusal_comes_back(
    cluster: Cluster,
) -> None:
    """A 1.1 MB prompt crosses server, ingress and engine; the engine reads all of it (its JSON
    parses: the body ends after the prompt) and refuses it for its context, and that refusal,
    not a cut body (502) or a limit of ours (413: the body is under 8 MiB), is what the client
    gets."""
    caller = "caller-megabyte"
    out = cluster.chat("--prompt-bytes", str(PROMPT_BYTES), "--caller", caller)
    assert out[0] == "HEAD 400", out[:1]
    error = json.loads(out[1].removeprefix("BODY "))
    assert error["code"] == "engine_rejected", error
    counted = re.fullmatch(
        r"request \((\d+) tokens\) exceeds the available context size \((\d+) tokens\).*",
        error["message"],
    )
    assert counted is not None, error["message"]
    # The engine tokenized the whole prompt (about one token per 2.3 bytes of this text).
    assert int(counted[1]) > PROMPT_BYTES // 3 > int(counted[2]), error["message"]
    # The server routed it to a host, whose log of that engine shows the engine's own refusal.
    picks = [e for e in events(cluster.server_log, "router_selection")
             if e.get("caller_request_id") == caller]  # fmt: skip
    assert len(picks) == 1
    engine_logs = (cluster.host_state(picks[0]["host"]) / "logs").glob("*.log")
    refusals = [line for p in engine_logs for line in _lines(p)
                if f"request ({counted[1]} tokens) exceeds" in line]  # fmt: skip
    assert len(refusals) == 1, refusals


def test_a_spent_join_file_and_a_request_without_the_gate_key_are_refused(
    cluster: Cluster,
) -> None:
    join_file = cluster.invite("box-c")
    first = cluster.join("box-a", join_file)  # box-a's namespace, a fresh state directory
    assert first.returncode != 0 and "enrolled already" in first.stderr
    again = cluster.net.run(cluster.net.hosts["box-b"], [GATEWAY, "host", "join", "--join-file",
                            str(join_file), "--state-dir", str(cluster.tmp / "c1")])  # fmt: skip
    assert again.returncode == 0, again.stderr
    spent = cluster.net.run(cluster.net.hosts["box-b"], [GATEWAY, "host", "join", "--join-file",
                            str(join_file), "--state-dir", str(cluster.tmp / "c2")])  # fmt: skip
    assert spent.returncode != 0 and "used or voided already" in spent.stderr
    ingress = f"http://{cluster.net.hosts['box-a'].address}:8444"
    path = cluster.status()["instances"][0]["url"].split(":8444", 1)[1]
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    for key in (None, cluster.key, "0" * 64):
        args = [f"--key={key}"] if key is not None else []  # a key may begin with "-"
        done = cluster.net.run(cluster.net.server, [*CLIENT, "post", "--url", ingress + path
                               + "/v1/chat/completions", "--body", body, *args])  # fmt: skip
        assert done.stdout.splitlines()[0] == "HEAD 401", done.stdout


def test_a_hang_up_closes_the_engine_connection_on_the_host(cluster: Cluster) -> None:
    settled_before = len(_settled_lines(cluster))
    client = cluster.chat_pipe("--stream", "--max-tokens", "2000", "--hang-up-after-content")
    out = drain(client)
    assert out[-1] == "HUNG UP", out[-3:]
    # The server cut it, and settled it on its host's report: the ingress had nothing in
    # flight and the engine ran and waited for nothing in a sample taken after the cut.
    end = time.monotonic() + 30
    while True:
        doc = cluster.status()
        cut = [c for i in doc["instances"] for c in i["cancelled"]]
        if not cut or time.monotonic() > end:
            break
        time.sleep(0.25)
    assert cut == []
    assert len(_settled_lines(cluster)) == settled_before + 1, "not settled on its host's report"
    for row in doc["instances"]:
        assert row["ingress_in_flight"] == 0 and row["running"] == 0


def test_a_network_cut_is_noticed_within_seconds_and_ends_the_stream_through_it(
    cluster: Cluster,
) -> None:
    # One long stream on each host (the second goes where nothing runs yet).
    clients = [cluster.chat_pipe("--stream", "--max-tokens", "1500") for _ in range(2)]
    for c in clients:
        assert c.stdout.readline().strip() == "HEAD 200"
        assert c.stdout.readline().startswith("DATA ")
    lost_before = cluster.sessions("box-b", "lost")
    cluster.net.link_down("box-b")  # no reset, no close: the link just goes silent
    cut_at = time.monotonic()
    wait_for(cluster.server_log, lambda _: cluster.sessions("box-b", "lost") > lost_before, 10)
    noticed = time.monotonic() - cut_at
    assert noticed < 6, f"noticed after {noticed:.1f} s"
    outs = [drain(c) for c in clients]
    ended_in_band = [o for o in outs if any('"error"' in line for line in o[-3:])]
    finished = [o for o in outs if any("[DONE]" in line for line in o)]
    assert len(ended_in_band) == 1 and len(finished) == 1, [o[-3:] for o in outs]
    for _ in range(3):
        assert cluster.chat("--max-tokens", "4")[0] == "HEAD 200"
    b = next(i for i in cluster.status()["instances"] if i["host"] == "box-b")
    assert b["session"] == "lost"
    live_before = cluster.sessions("box-b", "live")
    cluster.net.link_up("box-b")
    wait_for(cluster.server_log, lambda _: cluster.sessions("box-b", "live") > live_before, 20)


def idle_both(cluster: Cluster, within: float = 30) -> None:
    """Wait until both hosts report a fresh sample of an idle engine and an idle ingress."""
    end = time.monotonic() + within
    while True:
        rows = cluster.status()["instances"]
        if all(r.get("running") == 0 and r.get("ingress_in_flight") == 0 for r in rows):
            return
        assert time.monotonic() < end, rows
        time.sleep(0.25)


def picked_host(cluster: Cluster, caller: str) -> str:
    picks = [e for e in events(cluster.server_log, "router_selection")
             if e.get("caller_request_id") == caller]  # fmt: skip
    assert len(picks) == 1, picks
    host: str = picks[0]["host"]
    return host


def test_a_host_killed_mid_stream_ends_its_stream_in_band_and_its_engine_with_it(
    cluster: Cluster,
) -> None:
    doc = cluster.status()
    a = next(i for i in doc["instances"] if i["host"] == "box-a")
    engine = int(a["process"]["pid"])  # the engine's own (a host reports no reaper_pid)
    reaper = int(Path(f"/proc/{engine}/stat").read_text().rpartition(")")[2].split()[1])
    assert reaper != cluster.hosts["box-a"].pid  # it runs under a reaper, not the host itself
    # Both instances busy with one long stream each, so that one runs on box-a. Routing weighs
    # the engines' own samples: wait until both report idle (a sample taken during the tests
    # before may still be fresh and count a request that is over).
    idle_both(cluster)
    callers = [f"killed-{n}" for n in range(2)]
    clients = [cluster.chat_pipe("--stream", "--max-tokens", "3000", "--caller", caller)
               for caller in callers]  # fmt: skip
    for c in clients:
        assert c.stdout.readline().strip() == "HEAD 200"
        assert c.stdout.readline().startswith("DATA ")
    cluster.net.kill(cluster.hosts.pop("box-a"))
    outs = [drain(c) for c in clients]
    hosts = [picked_host(cluster, caller) for caller in callers]
    assert sorted(hosts) == HOSTS, hosts
    through_a, through_b = (outs[hosts.index(h)] for h in HOSTS)
    assert through_a[-1] == "END" and through_b[-1] == "END"
    assert not any("[DONE]" in line for line in through_a), through_a[-3:]
    assert any('"error"' in line for line in through_a[-3:]), through_a[-3:]
    assert through_b[-2] == "DATA data: [DONE]", through_b[-3:]
    # Its engine went with it (its reaper is told when the host process dies).
    assert gone(reaper, within=30) and gone(engine, within=30)
    wait_for(cluster.server_log, lambda _: cluster.sessions("box-a", "lost") >= 1, 10)
    for _ in range(2):
        assert cluster.chat("--max-tokens", "4")[0] == "HEAD 200"
