"""Network namespaces for the live tier: one *server* and N *hosts*, each a separate network
namespace, each host joined to the server by its own veth pair, so that capyctl-gateway's server
and hosts run as separate processes on separate "machines" with all traffic inside them.

Addresses: host number ``i`` (1-based, in the order given) sits on ``10.200.i.0/30``, the server
at ``10.200.i.1`` (`Net.server_address`), the host at ``10.200.i.2`` (``Machine.address``). The
server also has ``10.200.0.1`` on its loopback (``net.server.address``), routed from every host
over its own link: one address for the server that every host reaches. Hosts have no other
routes and the server does not forward, so hosts cannot reach each other, and nothing is routed
to or from the root namespace.

Processes started with `Net.popen` run in their own session (process group) under
``PR_SET_PDEATHSIG`` = SIGKILL, so they die with the process that started them even when it is
SIGKILLed (``ip netns exec`` execs its command, so the setting stays on the real process). The
kernel sends that signal when the *thread* that started them exits: call `Net.popen` from a
thread that lives as long as the processes should (the main thread, not a worker thread).
Namespaces left behind by a run that was killed (named ``cx<pid>-…`` after a process that is
gone) are deleted by the next `Net` that starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import re
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KILL_GRACE_S", "Machine", "Net", "netns_unavailable"]

KILL_GRACE_S = 5.0
"""On exit, started processes get SIGTERM, and SIGKILL (their whole group) after this."""
NETNS_DIR = Path("/run/netns")
_PREFIX = "cx"
_STALE = re.compile(rf"^{_PREFIX}(\d+)-\d+-")
_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")
_HOST_IF = "eth0"
_counter = itertools.count()
_PR_SET_PDEATHSIG = 1


@functools.cache
def _ip_binary() -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin", "/sbin"])
    return shutil.which("ip", path=path)


def _ip(*args: str, batch: Iterable[str] = ()) -> None:
    """``ip ARGS`` (with ``-b -`` and the lines of ``batch`` on stdin, if any); raise on failure."""
    ip = _ip_binary()
    if ip is None:
        raise RuntimeError("no `ip` command")
    lines = list(batch)
    argv = [ip, *args, *(["-b", "-"] if lines else [])]
    r = subprocess.run(
        argv, input="".join(f"{line}\n" for line in lines), capture_output=True, text=True
    )
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")


@functools.cache
def netns_unavailable() -> str | None:
    """Why network namespaces (with veth pairs) cannot be used here, or None when they can.

    Probed once per process by really adding a throwaway namespace, a veth pair in it, and
    deleting it again."""
    if os.geteuid() != 0:
        return "not root (network namespaces need CAP_SYS_ADMIN)"
    if _ip_binary() is None:
        return "no `ip` command (iproute2) on PATH"
    probe = f"{_PREFIX}{os.getpid()}-{next(_counter)}-probe"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as e:
        return f"`ip netns add` fails: {e}"
    reason = None
    try:
        _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
    except RuntimeError as e:
        reason = f"veth pairs cannot be made: {e}"
    try:
        _ip("netns", "del", probe)
    except RuntimeError as e:
        reason = reason or f"`ip netns del` fails: {e}"
    return reason


@dataclass
class Machine:
    """One network namespace: the server or a host."""

    name: str
    """``"server"``, or the host's name as given to `Net`."""
    netns: str
    """The namespace's real name (for ``ip netns exec`` / ``ip -n``)."""
    address: str
    """A host's address on its link to the server; the server's address that every host
    reaches (on its loopback). `Net.server_address` gives the server's address on one link."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6", use_errno=True)


def _die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGKILL when the thread that forked it exits."""
    prctl = _libc().prctl  # looked up before the fork, not in the child
    parent = os.getpid()

    def preexec() -> None:
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != parent:  # the parent died before the prctl: nobody will signal us
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_exited(pidfds: list[int], deadline: float) -> list[int]:
    """Wait until every pidfd turns readable (its process exited) or ``deadline``; return the
    pidfds still running."""
    waiting = list(pidfds)
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select(waiting, [], [], left)
        waiting = [fd for fd in waiting if fd not in ready]
    return waiting


def _ns_id(path: str | Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:  # gone, or a zombie (which has no namespaces any more)
        return None
    return st.st_dev, st.st_ino


def _pids_in(netns: str) -> list[int]:
    """The processes whose network namespace is ``netns`` (like ``ip netns pids``)."""
    want = _ns_id(NETNS_DIR / netns)
    if want is None:
        return []
    return [
        int(e) for e in os.listdir("/proc") if e.isdigit() and _ns_id(f"/proc/{e}/ns/net") == want
    ]


def _kill_all_in(namespaces: list[str], within: float) -> None:
    """SIGKILL every process in ``namespaces`` and wait (up to ``within`` s) until they exit."""
    fds = []
    try:
        for ns in namespaces:
            want = _ns_id(NETNS_DIR / ns)
            for pid in _pids_in(ns):
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    continue
                fds.append(fd)
                # The pidfd pins the process: check again that the pid is still the one found.
                if _ns_id(f"/proc/{pid}/ns/net") == want:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
        _wait_exited(fds, time.monotonic() + within)
    finally:
        for fd in fds:
            os.close(fd)


def _sweep_stale() -> None:
    """Delete the namespaces of runs that were killed before they could (``cx<pid>-…`` of a
    process that is gone)."""
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return
    stale = [n for n in names if (m := _STALE.match(n)) and not _pid_alive(int(m.group(1)))]
    if stale:
        _kill_all_in(stale, within=KILL_GRACE_S)
        with contextlib.suppress(RuntimeError):  # best effort: another run may sweep too
            _ip("-force", batch=[f"netns del {n}" for n in stale])


class Net:
    """A server namespace and one namespace per host, each host joined to the server by its own
    veth pair on its own ``/30``; loopback up in every namespace; hosts reach only the server.

    Use as a context manager: entering creates everything (and on any failure removes what it
    made and raises); leaving kills every process started in it (``popen``) and deletes the
    namespaces, which deletes the veth pairs. Namespace names carry a prefix unique to this
    process and this `Net` (``cx<pid>-<n>-<machine>``), so parallel runs never collide.
    """

    def __init__(self, hosts: list[str]) -> None:
        if len(hosts) > 254:
            raise ValueError("at most 254 hosts")
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"host names repeat: {hosts}")
        for name in hosts:
            if name == "server" or not _HOST_NAME.match(name):
                raise ValueError(f"bad host name {name!r}")
        prefix = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        self.server = Machine("server", f"{prefix}-server", "10.200.0.1")
        self.hosts = {
            name: Machine(name, f"{prefix}-{name}", f"10.200.{i}.2")
            for i, name in enumerate(hosts, 1)
        }
        self._index = {name: i for i, name in enumerate(hosts, 1)}
        self._procs: list[subprocess.Popen[bytes]] = []
        self._state = "new"

    # -- the namespaces ------------------------------------------------------------------------

    def _namespaces(self) -> list[str]:
        return [self.server.netns, *(m.netns for m in self.hosts.values())]

    def server_address(self, host: str) -> str:
        """The server's address on ``host``'s link."""
        return f"10.200.{self._index[host]}.1"

    def _server_if(self, host: str) -> str:
        return f"veth{self._index[host]}"

    def __enter__(self) -> Net:
        if self._state != "new":
            raise RuntimeError("a Net is entered once")
        reason = netns_unavailable()
        if reason is not None:
            raise RuntimeError(f"network namespaces unavailable: {reason}")
        self._state = "entered"
        try:
            _sweep_stale()
            _ip(batch=[f"netns add {ns}" for ns in self._namespaces()])
            server = ["link set lo up", f"addr add {self.server.address}/32 dev lo"]
            for name, host in self.hosts.items():
                veth = self._server_if(name)
                server += [
                    f"link add {veth} type veth peer name {_HOST_IF} netns {host.netns}",
                    f"addr add {self.server_address(name)}/30 dev {veth}",
                    f"link set {veth} up",
                ]
            _ip("-n", self.server.netns, batch=server)
            for name, host in self.hosts.items():
                _ip(
                    "-n",
                    host.netns,
                    batch=[
                        "link set lo up",
                        f"addr add {host.address}/30 dev {_HOST_IF}",
                        f"link set {_HOST_IF} up",
                        self._route_to_server(name),
                    ],
                )
        except BaseException:
            self.__exit__()
            raise
        return self

    def _route_to_server(self, host: str) -> str:
        return f"route replace {self.server.address}/32 via {self.server_address(host)}"

    def __exit__(self, *exc: object) -> None:
        if self._state != "entered":
            return
        self._state = "exited"
        try:
            self._stop_all()
        finally:
            namespaces = self._namespaces()
            _kill_all_in(namespaces, within=KILL_GRACE_S)
            existing = [ns for ns in namespaces if (NETNS_DIR / ns).exists()]
            if existing:
                _ip("-force", batch=[f"netns del {ns}" for ns in existing])
            left = [ns for ns in namespaces if (NETNS_DIR / ns).exists()]
            if left:
                raise RuntimeError(f"namespaces not deleted: {left}")

    def _stop_all(self) -> None:
        """SIGTERM each started process group, SIGKILL after `KILL_GRACE_S`, reap."""
        running = [p for p in self._procs if p.returncode is None]
        fds: dict[int, subprocess.Popen[bytes]] = {}
        try:
            for p in running:
                # Until it is reaped, the leader's pid (= its group's id) is nobody else's.
                fds[os.pidfd_open(p.pid)] = p
                _killpg(p.pid, signal.SIGTERM)
            _wait_exited(list(fds), time.monotonic() + KILL_GRACE_S)
            for p in running:
                _killpg(p.pid, signal.SIGKILL)  # also what is left of the group
                p.wait()
        finally:
            for fd in fds:
                os.close(fd)

    # -- links ---------------------------------------------------------------------------------

    def link_down(self, host: str) -> None:
        """Cut ``host``'s link to the server: both ends of its veth pair down."""
        _ip("-n", self.server.netns, "link", "set", self._server_if(host), "down")
        _ip("-n", self.hosts[host].netns, "link", "set", _HOST_IF, "down")

    def link_up(self, host: str) -> None:
        """Mend ``host``'s link (and the host's route to ``server.address``, which the kernel
        dropped with the link)."""
        _ip("-n", self.server.netns, "link", "set", self._server_if(host), "up")
        _ip(
            "-n",
            self.hosts[host].netns,
            batch=[f"link set {_HOST_IF} up", self._route_to_server(host)],
        )

    # -- processes -----------------------------------------------------------------------------

    def _argv(self, machine: Machine, argv: list[str]) -> list[str]:
        if self._state != "entered":
            raise RuntimeError("the Net is not entered")
        ip = _ip_binary()
        assert ip is not None  # checked on entering
        return [ip, "netns", "exec", machine.netns, *argv]

    def popen(
        self,
        machine: Machine,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        log: Path,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``machine``'s namespace, in a new session (its own process
        group), stdout and stderr appended to ``log``; ``env`` is added to this process's
        environment. The process dies with the calling thread and is stopped when the `Net`
        exits."""
        full = self._argv(machine, argv)
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            proc = subprocess.Popen(
                full,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=None if env is None else {**os.environ, **env},
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )
        self._procs.append(proc)
        return proc

    def pipe(self, machine: Machine, argv: list[str]) -> subprocess.Popen[str]:
        """Start ``argv`` inside ``machine``'s namespace with its stdout a pipe to read (text,
        line-buffered), its stderr discarded; stopped when the `Net` exits."""
        proc = subprocess.Popen(
            self._argv(machine, argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            start_new_session=True,
            preexec_fn=_die_with_parent(),
        )
        self._procs.append(proc)  # type: ignore[arg-type]
        return proc

    def run(
        self, machine: Machine, argv: list[str], timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``machine``'s namespace to completion and capture its output
        (text); its whole process group is killed if it outlasts ``timeout`` (which raises
        `subprocess.TimeoutExpired`). The exit status is not checked."""
        full = self._argv(machine, argv)
        with subprocess.Popen(
            full,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=_die_with_parent(),
        ) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                _killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise
        return subprocess.CompletedProcess(full, proc.returncode, out, err)

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL ``proc``'s whole process group and wait for ``proc``."""
        if proc.returncode is None:  # not reaped: its pid is still its group's id
            _killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
