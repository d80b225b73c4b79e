"""FakeKubelet: the scheduler, a kubelet for each of its nodes and the node controller, in one,
in-process against a FakeApiServer's store. It follows the store as an informer does (a watch
of every pod) and writes through the same path as an API write (resourceVersion bumped, watch
event sent). Each bound pod is a PodWorker (container.py): a real local process.

Faults on demand: ``evict``, ``kill``, ``cordon``/``uncordon``, ``add_node``, ``lose_node``/
``restore_node``. On exit it SIGKILLs every process it started and waits for them.

Departures: a lost node's pods are marked not Ready (reason NodeLost) and deleted at once (the
real taint manager waits tolerationSeconds, 300 s by default, and sets no reason); there are no
Node objects in the API; ``processes`` is keyed by pod name alone (not namespace).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import shutil
import signal
import socket
import tempfile
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import aiohttp

from tests.kube.apiserver import FakeApiServer
from tests.kube.container import PodWorker
from tests.kube.objects import ApiError
from tests.kube.scheduler import FakeNode, Scheduler, set_condition
from tests.kube.store import Change

__all__ = ["FakeKubelet", "FakeNode"]

Obj = dict[str, Any]
TERMINAL = ("Succeeded", "Failed")


LEASES = Path(tempfile.gettempdir()) / "fake-kubelet-addresses"


def _lease(x: int) -> IO[str] | None:
    """Hold 127.0.0.X for a pod (an flock, let go with the file or the process), or None."""
    LEASES.mkdir(exist_ok=True)
    held = (LEASES / f"127.0.0.{x}").open("a")
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.close()
        return None
    return held


def _bindable(host: str, ports: set[int] | frozenset[int]) -> bool:
    for port in ports:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError:
                return False
    return True


class FakeKubelet:
    def __init__(
        self, api: FakeApiServer, nodes: list[FakeNode] | None = None, *, time_scale: float = 1.0
    ) -> None:
        self.api = api
        self.time_scale = time_scale
        self.scheduler = Scheduler(api.store, nodes if nodes is not None else [FakeNode("node-1")])
        self.workers: dict[str, PodWorker] = {}  # by pod uid
        self.processes: dict[str, int] = {}  # pod name -> pid of its running container
        self.ips: dict[str, int] = {}  # pod uid -> X of 127.0.0.X
        self._leases: dict[str, IO[str]] = {}
        self.log_dir = Path()
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self._try: set[str] | None = set()  # pods for the next scheduling pass; None: all
        self._terminal: set[str] = set()
        self._http: aiohttp.ClientSession | None = None

    @property
    def nodes(self) -> dict[str, FakeNode]:
        return self.scheduler.nodes

    @property
    def http(self) -> aiohttp.ClientSession:
        assert self._http is not None, "use the kubelet in `async with`"
        return self._http

    async def __aenter__(self) -> FakeKubelet:
        self.log_dir = Path(tempfile.mkdtemp(prefix="fake-kubelet-"))
        # As the real prober: no keep-alive, its own User-Agent.
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True),
            headers={"User-Agent": "kube-probe/1.37"},
        )
        self.api.logs = self
        self._tasks = [asyncio.create_task(self._follow()), asyncio.create_task(self._schedule())]
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        for t in self._tasks:
            t.cancel()
        workers = [w for w in self.workers.values() if not w.task.done()]
        for w in workers:
            w.task.cancel()  # its way out SIGKILLs the process group and waits for the process
        await asyncio.gather(*self._tasks, *(w.task for w in workers), return_exceptions=True)
        if self._http is not None:
            await self._http.close()
        self.api.logs = None
        for uid in list(self.ips):
            self.release_ip(uid)
        shutil.rmtree(self.log_dir, ignore_errors=True)

    # following the API ----------------------------------------------------------------------

    async def _follow(self) -> None:
        store = self.api.store
        w = store.watcher(None)
        for kind, pod in store.watch(w, None):
            self._on(kind, pod)
        try:
            while True:
                item = await w.queue.get()
                if isinstance(item, Change) and (event := w.convert(item)) is not None:
                    self._on(*event)
        finally:
            store.unwatch(w)

    def _on(self, kind: str, pod: Obj) -> None:
        uid, node = pod["metadata"]["uid"], pod["spec"].get("nodeName")
        worker = self.workers.get(uid)
        if kind == "DELETED":
            if worker is not None:
                worker.update(None)
            self.release_ip(uid)
            self._terminal.discard(uid)
            self.wake()
            return
        if not node:
            if kind == "ADDED":
                self.wake(uid)
            return
        if pod["status"].get("phase") in TERMINAL and uid not in self._terminal:
            self._terminal.add(uid)
            self.wake()
        if worker is not None:
            worker.update(pod)
        elif (
            node in self.nodes
            and not self.nodes[node].lost
            and pod["status"].get("phase") not in TERMINAL
        ):
            self.workers[uid] = PodWorker(self, pod)

    # the scheduler ----------------------------------------------------------------------------

    def wake(self, uid: str | None = None) -> None:
        """Have the scheduler try pod ``uid`` (None: every pending pod: something freed up)."""
        if uid is None or self._try is None:
            self._try = None
        else:
            self._try.add(uid)
        self._wake.set()

    async def _schedule(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            only, self._try = self._try, set()
            self.scheduler.schedule(only)

    def add_node(self, node: FakeNode) -> None:
        self.nodes[node.name] = node
        self.wake()

    def cordon(self, node: str) -> None:
        self.nodes[node].unschedulable = True

    def uncordon(self, node: str) -> None:
        self.nodes[node].unschedulable = False
        self.wake()

    # addresses and logs ---------------------------------------------------------------------

    def take_ip(self, uid: str, ports: set[int] | frozenset[int] = frozenset()) -> str:
        """The pod's address: the lowest 127.0.0.X (X from 2) that no live pod holds, here or in
        another test process (a lock file each), and where its ``ports`` are free."""
        if uid not in self.ips:
            for need_ports in (True, False):  # none with the ports free: the process will say so
                for x in range(2, 255):
                    if x in self.ips.values() or (lease := _lease(x)) is None:
                        continue
                    if need_ports and not _bindable(f"127.0.0.{x}", ports):
                        lease.close()
                        continue
                    self.ips[uid], self._leases[uid] = x, lease
                    return f"127.0.0.{x}"
            raise RuntimeError("the fake kubelet ran out of 127.0.0.X addresses")
        return f"127.0.0.{self.ips[uid]}"

    def release_ip(self, uid: str) -> None:
        self.ips.pop(uid, None)
        if (lease := self._leases.pop(uid, None)) is not None:
            lease.close()

    def log_file(self, pod: Obj, container: str, previous: bool) -> Path:
        """The log route's source (LogSource): the file of the container's current run."""
        w, name = self.workers.get(pod["metadata"]["uid"]), pod["metadata"]["name"]
        if previous:
            if w is None or len(w.runs) < 2:
                raise ApiError(
                    400, f'previous terminated container "{container}" in pod "{name}" not found'
                )
            return w.runs[-2]
        if w is None or not w.runs:
            states = [s["state"] for s in pod["status"].get("containerStatuses") or []]
            why = (
                next((s["waiting"].get("reason") for s in states if "waiting" in s), None)
                or "ContainerCreating"
            )
            raise ApiError(
                400, f'container "{container}" in pod "{name}" is waiting to start: {why}'
            )
        return w.runs[-1]

    def writing(self, pod: Obj) -> bool:
        w = self.workers.get(pod["metadata"]["uid"])
        return w is not None and not w.task.done() and not w.abandoned

    # faults ---------------------------------------------------------------------------------

    def _worker(self, name: str, namespace: str) -> PodWorker:
        pod = self.api.store.get_pod(namespace, name)
        w = self.workers.get(pod["metadata"]["uid"])
        if w is None or w.proc is None or w.task.done():
            raise LookupError(f"pod {namespace}/{name} has no running container on this kubelet")
        return w

    async def evict(
        self,
        name: str,
        namespace: str = "default",
        message: str = "The node was low on resource: memory.",
    ) -> None:
        """Evict the pod as the kubelet under node pressure does: its process killed, phase
        Failed with reason Evicted and ``message``; the object stays. Returns once written."""
        w = self._worker(name, namespace)
        w.evicted, w.kill_reason = message, "evict"
        w.changed.set()
        self.api.store.record_event(w.pod, "Evicted", message, component="kubelet", host=w.node)
        with contextlib.suppress(Exception):
            await asyncio.shield(w.task)

    async def kill(self, name: str, namespace: str = "default", sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the pod's processes (its engine crashing); the usual handling of the
        exit follows. Returns once that exit is written."""
        w = self._worker(name, namespace)
        w._signal(sig)
        await w.exited.wait()

    async def lose_node(self, node: str) -> None:
        """The node goes dark: its processes die, its kubelet writes nothing more; the node
        controller marks its pods not Ready and deletes them. They stay Terminating (nobody
        confirms the kill) until ``restore_node`` or a DELETE with grace 0."""
        n = self.nodes[node]
        n.lost = True
        workers = [w for w in self.workers.values() if w.node == node and not w.task.done()]
        for w in workers:
            w.abandoned = True
            w.changed.set()
        await asyncio.gather(*(w.task for w in workers), return_exceptions=True)
        store = self.api.store
        for pod in [p for p in store.pods.values() if p["spec"].get("nodeName") == node]:
            meta = pod["metadata"]

            def not_ready(p: Obj) -> None:
                set_condition(
                    p, "Ready", "False", "NodeLost", "Kubelet stopped posting node status."
                )
                set_condition(
                    p,
                    "DisruptionTarget",
                    "True",
                    "DeletionByTaintManager",
                    "Taint manager: deleting due to NoExecute taint",
                )

            marked = store.update_pod(meta["namespace"], meta["name"], not_ready)
            store.record_event(
                marked, "NodeNotReady", "Node is not ready", component="node-controller"
            )
            store.delete_pod(meta["namespace"], meta["name"])

    async def restore_node(self, node: str) -> None:
        """The node's kubelet is back: it finds its pods' containers gone, reports them so
        (ContainerStatusUnknown, phase Failed) and lets deleted ones go. Returns once done."""
        self.nodes[node].lost = False
        workers = []
        for pod in [p for p in self.api.store.pods.values() if p["spec"].get("nodeName") == node]:
            w = PodWorker(self, pod, recovered=True)
            self.workers[w.uid] = w
            workers.append(w)
        self.wake()
        await asyncio.gather(*(w.task for w in workers), return_exceptions=True)
