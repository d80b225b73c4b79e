"""The live tier's network-namespace harness (`contract.live.netns`): a server and two hosts in
their own namespaces, traffic only inside them; hosts reach the server, not each other nor the
root namespace; a link cut fails connections and mending it restores them; leaving the `Net`
kills what it started and deletes the namespaces; started processes die with their starter even
when it is SIGKILLed."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from contract.live import gone, netns
from contract.live.netns import Machine, Net, netns_unavailable

REPO = Path(__file__).resolve().parents[2]

SERVE = r"""
import socket, sys
port, name = int(sys.argv[1]), sys.argv[2]
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", port))
s.listen()
while True:
    c, _ = s.accept()
    with c:
        c.sendall(f"hello from {name}\n".encode())
"""

CONNECT = r"""
import socket, sys, time
addr, port, wait = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + wait
while True:
    try:
        with socket.create_connection((addr, port), timeout=1) as c:
            print(c.makefile().readline().strip())
            sys.exit(0)
    except OSError as e:
        if time.monotonic() >= deadline:
            print(f"failed: {type(e).__name__}: {e}")
            sys.exit(1)
        time.sleep(0.02)  # polling a listener that may not be up yet, up to the deadline
"""
"""Connect to ADDR PORT and print the line the listener sends, retrying any failure for WAIT s
(0: one attempt of at most 1 s)."""

HOSTS = ["gpu-box", "gpu-box-2"]


@pytest.fixture(autouse=True)
def _namespaces_available() -> None:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"not run: network namespaces are unavailable here: {reason}")


@pytest.fixture
def net() -> Iterator[Net]:
    with Net(HOSTS) as n:
        yield n


def reach(net: Net, machine: Machine, addr: str, port: int, wait: float = 0) -> str:
    """What ``machine`` gets from the listener at ``addr:port`` (or ``failed: …``)."""
    r = net.run(machine, [sys.executable, "-c", CONNECT, addr, str(port), str(wait)])
    return r.stdout.strip() or r.stderr.strip()


def reach_from_here(addr: str, port: int) -> str:
    try:
        with socket.create_connection((addr, port), timeout=0.5) as c:
            return c.makefile().readline().strip()
    except OSError as e:
        return f"failed: {type(e).__name__}: {e}"


def serve(net: Net, machine: Machine, port: int, log: Path) -> subprocess.Popen[bytes]:
    return net.popen(machine, [sys.executable, "-c", SERVE, str(port), machine.name], log=log)


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def names(net: Net) -> set[str]:
    return {net.server.netns, *(m.netns for m in net.hosts.values())}


def dead(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie (nobody may reap an orphan here at once)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def wait_for(check: Callable[[], bool], what: str, within: float = 10) -> None:
    """Poll ``check()`` until it is true, up to ``within`` s."""
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except FileNotFoundError:
        return ""


def test_hosts_reach_the_server_and_nothing_else(net: Net, tmp_path: Path) -> None:
    box, box2, server = net.hosts["gpu-box"], net.hosts["gpu-box-2"], net.server
    assert (box.address, net.server_address("gpu-box")) == ("10.200.1.2", "10.200.1.1")
    assert (box2.address, net.server_address("gpu-box-2")) == ("10.200.2.2", "10.200.2.1")
    for m in (server, box, box2):
        lo = net.run(m, ["ip", "-o", "link", "show", "lo"])
        assert ",UP," in lo.stdout, lo

    serve(net, box, 7000, tmp_path / "box.log")
    serve(net, server, 7001, tmp_path / "server.log")
    # The server reaches the host (waiting for its listener), and each host the server, both at
    # the server's address on its own link and at the one address every host reaches.
    assert reach(net, server, box.address, 7000, wait=10) == "hello from gpu-box"
    for host in (box, box2):
        assert reach(net, host, server.address, 7001, wait=10) == "hello from server"
        assert reach(net, host, net.server_address(host.name), 7001) == "hello from server"

    # Both listeners are up: what does not reach them cannot.
    assert reach(net, box2, box.address, 7000).startswith("failed:")
    assert reach_from_here(box.address, 7000).startswith("failed:")
    assert reach_from_here(server.address, 7001).startswith("failed:")


def test_popen_runs_the_command_itself_in_the_namespace(net: Net, tmp_path: Path) -> None:
    """``ip netns exec`` execs the command: the process popen returns *is* it (so it keeps the
    parent-death signal), in its own process group, in the host's namespace."""
    box = net.hosts["gpu-box"]
    proc = net.popen(box, ["sleep", "300"], log=tmp_path / "sleep.log")
    wait_for(lambda: comm(proc.pid) == "sleep", "ip to exec sleep")
    assert os.getpgid(proc.pid) == proc.pid
    mine = os.stat(f"/proc/{proc.pid}/ns/net")
    named = os.stat(f"/run/netns/{box.netns}")
    assert (mine.st_dev, mine.st_ino) == (named.st_dev, named.st_ino)
    assert os.stat("/proc/self/ns/net").st_ino != mine.st_ino
    net.kill(proc)
    assert proc.returncode == -signal.SIGKILL


def test_link_down_cuts_and_link_up_mends(net: Net, tmp_path: Path) -> None:
    box, server = net.hosts["gpu-box"], net.server
    serve(net, box, 7000, tmp_path / "box.log")
    serve(net, server, 7001, tmp_path / "server.log")
    assert reach(net, server, box.address, 7000, wait=10) == "hello from gpu-box"

    net.link_down("gpu-box")
    assert reach(net, server, box.address, 7000).startswith("failed:")
    assert reach(net, box, server.address, 7001).startswith("failed:")
    # The other host's link is untouched.
    assert reach(net, net.hosts["gpu-box-2"], server.address, 7001, wait=10) == "hello from server"

    net.link_up("gpu-box")
    assert reach(net, server, box.address, 7000, wait=10) == "hello from gpu-box"
    assert reach(net, box, server.address, 7001, wait=10) == "hello from server"


def test_exit_kills_what_was_started_and_deletes_the_namespaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(netns, "KILL_GRACE_S", 0.5)
    with Net(HOSTS) as net:
        made = names(net)
        assert made <= namespaces()
        box, box2 = net.hosts["gpu-box"], net.hosts["gpu-box-2"]
        # A group with a child; a process that ignores SIGTERM; one that left its group.
        group = net.popen(box, ["sh", "-c", "sleep 300 & exec sleep 300"], log=tmp_path / "a.log")
        stubborn = net.popen(
            net.server, ["sh", "-c", "trap '' TERM; exec sleep 300"], log=tmp_path / "b.log"
        )
        escaped = net.popen(box2, ["setsid", "-f", "sleep", "300"], log=tmp_path / "c.log")
        wait_for(lambda: comm(stubborn.pid) == "sleep", "the SIGTERM-ignoring sleep")
        escaped.wait(10)
        wait_for(lambda: len(netns._pids_in(box.netns)) == 2, "the group's two processes")
        wait_for(lambda: len(netns._pids_in(box2.netns)) == 1, "the escaped sleep")
        pids = [p for ns in made for p in netns._pids_in(ns)]
        assert len(pids) == 4
        started = time.monotonic()
    took = time.monotonic() - started

    assert not made & namespaces()
    assert all(dead(pid) for pid in pids), [(p, comm(p)) for p in pids if not dead(p)]
    assert group.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL
    assert 0.5 <= took < 3, took
    net.__exit__(None, None, None)  # idempotent


def test_a_failed_entry_removes_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Net, "_route_to_server", lambda self, host: "route add nowhere")
    net = Net(HOSTS)
    with pytest.raises(RuntimeError, match="nowhere"):
        net.__enter__()
    assert not names(net) & namespaces()


CHILD = r"""
import sys
from pathlib import Path
from contract.live.netns import Net
net = Net(["gpu-box"]).__enter__()
p = net.popen(net.hosts["gpu-box"], ["sleep", "300"], log=Path(sys.argv[1]))
print(p.pid, net.server.netns, net.hosts["gpu-box"].netns, flush=True)
sys.stdin.read()
"""


def test_started_processes_die_with_a_killed_starter(tmp_path: Path) -> None:
    """The starter (standing in for pytest) is SIGKILLed: what it started dies too, and the
    namespaces it left are swept by the next Net."""
    starter = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "sleep.log")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    left: list[str] = []
    try:
        assert starter.stdout is not None
        assert select.select([starter.stdout], [], [], 30)[0], "the starter said nothing"
        pid_text, *left = starter.stdout.readline().split()
        pid = int(pid_text)
        wait_for(lambda: comm(pid) == "sleep", "ip to exec sleep")
        assert set(left) <= namespaces()

        starter.kill()
        starter.wait()
        assert gone(pid, within=10)
        assert set(left) <= namespaces()  # nobody deleted them ...
        with Net(["gpu-box"]):
            assert not set(left) & namespaces()  # ... until the next Net swept them
    finally:
        starter.kill()
        starter.wait()
        assert starter.stdin is not None and starter.stdout is not None
        starter.stdin.close()
        starter.stdout.close()
        for ns in set(left) & namespaces():
            subprocess.run(["ip", "netns", "del", ns], check=False)
