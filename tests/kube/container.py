"""One pod on the fake kubelet: its container run as a local process (own process group, output
to a log file), its probes, its status as the kubelet writes it, its termination.

Network stand-in: pods here share the host's loopback, so each gets an address 127.0.0.X of its
own (one where its container and probe ports are free, for other test processes run pods too)
and an argv value ``0.0.0.0`` (``--host 0.0.0.0``, ``--host=0.0.0.0``) becomes that address, as
a pod's own network namespace would make a wildcard bind reach only the pod's IP. A process that
binds another address, or 127.0.0.1, shares it with every other process here.

Probes (runtime.py checks them) honour initialDelaySeconds, periodSeconds (both times
``time_scale``), successThreshold and failureThreshold; readiness and liveness wait for startup.

Departures: one container per pod (more, or no ``command``, is a CreateContainerError); the
image is recorded, never pulled; the end of a container's main process kills its whole process
group (as the end of a container's PID 1 does); restart back-off is 10 s doubling, times
``time_scale``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.kube.objects import ApiError, image_id, now
from tests.kube.runtime import ConfigError, check, container_env, expand, ports
from tests.kube.scheduler import set_condition

if TYPE_CHECKING:
    from tests.kube.kubelet import FakeKubelet

__all__ = ["PodWorker"]

Obj = dict[str, Any]
log = logging.getLogger("tests.kube.kubelet")
WILDCARD = "0.0.0.0"  # noqa: S104 (an argv value to replace, never bound here)


class PodWorker:
    """The kubelet's work for one pod, from its binding to its removal (a task of its own)."""

    def __init__(self, kubelet: FakeKubelet, pod: Obj, *, recovered: bool = False) -> None:
        self.kubelet, self.pod, self.recovered = kubelet, pod, recovered
        meta = pod["metadata"]
        self.ns, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.node: str = pod["spec"]["nodeName"]
        self.c: Obj = pod["spec"]["containers"][0]
        self.removed = self.abandoned = self.started = self.ready = False
        self.kill_reason: str | None = None  # a probe's or the kubelet's (eviction: "evict")
        self.evicted: str | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.runs: list[Path] = []  # a log file per run of the container
        self.restarts = 0
        self.ip = ""
        self.started_at = ""
        self._last: Obj = {}  # the last run's end, as lastState
        self.changed = asyncio.Event()
        self.exited = asyncio.Event()  # set once a run's end is written
        self.startup = asyncio.Event()
        self.task = asyncio.create_task(self.run(), name=f"kubelet {self.ns}/{self.name}")

    def update(self, pod: Obj | None) -> None:
        """The pod as the kubelet's watch saw it now; None: removed from the API."""
        if pod is None:
            self.removed = True
        else:
            self.pod = pod
        self.changed.set()

    def terminating(self) -> bool:
        return self.removed or "deletionTimestamp" in self.pod["metadata"]

    # status ---------------------------------------------------------------------------------

    def _write(
        self,
        phase: str,
        cstate: Obj,
        *,
        last: Obj | None = None,
        reason: str | None = None,
        message: str | None = None,
    ) -> None:
        """Write the pod's status (no write when nothing changed; none once it is gone)."""
        current = self.kubelet.api.store.pods.get((self.ns, self.name))
        if self.abandoned or current is None or current["metadata"]["uid"] != self.uid:
            return
        name = self.c["name"]
        running = "running" in cstate
        ready = running and self.started and self.ready
        terminal = phase in ("Succeeded", "Failed")
        cs = {"name": name, "state": cstate, "lastState": last or {}, "ready": ready,
              "restartCount": self.restarts, "image": self.c["image"], "imageID": "",
              "started": running and self.started}  # fmt: skip
        if self.runs:
            cs["imageID"] = image_id(self.c["image"])
            cs["containerID"] = f"fake://{self.uid[:8]}-{len(self.runs)}"

        def apply(pod: Obj) -> None:
            s = pod["status"]
            s.update(
                phase=phase,
                hostIP="127.0.0.1",
                hostIPs=[{"ip": "127.0.0.1"}],
                containerStatuses=[cs],
            )
            s.setdefault("startTime", now())
            if self.ip:
                s.update(podIP=self.ip, podIPs=[{"ip": self.ip}])
            for key, value in (("reason", reason), ("message", message)):
                if value is None:
                    s.pop(key, None)
                else:
                    s[key] = value
            set_condition(pod, "PodReadyToStartContainers", "False" if terminal else "True")
            set_condition(pod, "Initialized", "True")
            if reason == "Evicted":
                set_condition(pod, "DisruptionTarget", "True", "TerminationByKubelet", message)
            for kind in ("Ready", "ContainersReady"):
                if ready:
                    set_condition(pod, kind, "True")
                elif terminal:
                    set_condition(
                        pod, kind, "False", "PodCompleted" if phase == "Succeeded" else "PodFailed"
                    )
                else:
                    set_condition(
                        pod,
                        kind,
                        "False",
                        "ContainersNotReady",
                        f"containers with unready status: [{name}]",
                    )

        self.pod = self.kubelet.api.store.update_pod(self.ns, self.name, apply)

    def _event(self, reason: str, message: str, type_: str = "Normal") -> None:
        if not self.abandoned:
            self.kubelet.api.store.record_event(
                self.pod, reason, message, type_=type_, component="kubelet", host=self.node
            )

    def _running(self) -> None:
        self._write("Running", {"running": {"startedAt": self.started_at}}, last=self._last)

    # the container ---------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            if self.recovered:
                gone = {"terminated": {"exitCode": 137, "reason": "ContainerStatusUnknown", "message": "The container could not be located when the pod was deleted.  The container used to be Running"}}  # fmt: skip
                self._write("Failed", gone)
            else:
                await self._lifecycle()
            if self.terminating() and not self.removed and not self.abandoned:
                self.kubelet.api.store.delete_pod(self.ns, self.name, 0, uid=self.uid)
        except ApiError as e:
            log.info("fake kubelet: %s/%s: %s", self.ns, self.name, e.message)
        except Exception:
            log.exception("fake kubelet: pod %s/%s", self.ns, self.name)
            raise
        finally:
            self.exited.set()
            await self._reap(signal.SIGKILL)
            if not self.abandoned:
                self.kubelet.release_ip(self.uid)

    async def _lifecycle(self) -> None:
        if self.terminating():
            return  # deleted before it started: nothing to stop
        self.ip = self.kubelet.take_ip(self.uid, ports(self.c))
        self._write("Pending", {"waiting": {"reason": "ContainerCreating"}})
        try:
            if len(self.pod["spec"]["containers"]) != 1:
                raise ConfigError(
                    "CreateContainerError", "the fake kubelet runs one container per pod"
                )
            env = container_env(self.pod, self.c)
            argv = [
                expand(a, env) for a in (self.c.get("command") or []) + (self.c.get("args") or [])
            ]
            if not self.c.get("command"):
                raise ConfigError(
                    "CreateContainerError", "the fake kubelet needs a command (images are not run)"
                )
        except ConfigError as e:
            log.error("fake kubelet: pod %s/%s cannot start: %s", self.ns, self.name, e.message)
            self._write("Pending", {"waiting": {"reason": e.reason, "message": e.message}})
            self._event("Failed", f"Error: {e.message}", "Warning")
            while not self.terminating() and not self.abandoned:
                self.changed.clear()
                await self.changed.wait()
            return
        argv = [
            self.ip if a == WILDCARD else a[:-7] + self.ip if a.endswith("=" + WILDCARD) else a
            for a in argv
        ]
        env = {**os.environ, "HOSTNAME": self.name, **env}
        policy = self.pod["spec"].get("restartPolicy", "Always")
        while not self.terminating() and not self.abandoned:
            code = await self._run_once(argv, env)
            if code is None:
                return
            if self.evicted is not None:
                self._write("Failed", self._last, reason="Evicted", message=self.evicted)
                return
            if self.terminating() or policy == "Never" or (policy == "OnFailure" and code == 0):
                self._write("Succeeded" if code == 0 else "Failed", self._last)
                return
            delay = min(10 * 2**self.restarts, 300)
            back = f"back-off {delay}s restarting failed container={self.c['name']} pod={self.name}_{self.ns}({self.uid})"
            self._write(
                "Running",
                {"waiting": {"reason": "CrashLoopBackOff", "message": back}},
                last=self._last,
            )
            self._event("BackOff", "Back-off restarting failed container", "Warning")
            self.exited.set()
            loop = asyncio.get_running_loop()
            until = loop.time() + delay * self.kubelet.time_scale
            while loop.time() < until and not self.terminating() and not self.abandoned:
                self.changed.clear()
                try:
                    await asyncio.wait_for(self.changed.wait(), until - loop.time())
                except TimeoutError:
                    break
            if self.terminating():
                self._write("Failed", self._last)
                return
            self.restarts += 1

    async def _run_once(self, argv: list[str], env: dict[str, str]) -> int | None:
        """Run the container once; its exit code (None if the pod went away meanwhile)."""
        self.exited.clear()
        self.startup.clear()
        self.started = self.ready = False
        self.kill_reason = None
        path = (
            self.kubelet.log_dir
            / f"{self.ns}_{self.name}_{self.uid}"
            / f"{self.c['name']}.{len(self.runs)}.log"
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        self.runs.append(path)
        try:
            with path.open("ab") as out:
                self.proc = await asyncio.create_subprocess_exec(
                    *argv, stdout=out, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                    env=env, cwd=self.c.get("workingDir"), start_new_session=True,
                )  # fmt: skip
        except OSError as e:
            self.started_at = now()
            self._last = {
                "terminated": {
                    "exitCode": 128,
                    "reason": "StartError",
                    "message": str(e),
                    "startedAt": self.started_at,
                    "finishedAt": now(),
                }
            }
            self._event("Failed", f"Error: {e}", "Warning")
            return 128
        self.kubelet.processes[self.name] = self.proc.pid
        self.started_at = now()
        probes = {
            k: self.c[k]
            for k in ("startupProbe", "readinessProbe", "livenessProbe")
            if self.c.get(k)
        }
        self.started = "startupProbe" not in probes
        self.ready = "readinessProbe" not in probes
        if self.started:
            self.startup.set()
        self._running()
        self._event("Started", f"Started container {self.c['name']}")
        tasks = [asyncio.create_task(self._probe(kind, spec)) for kind, spec in probes.items()]
        try:
            await self._supervise()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        code = self.proc.returncode
        assert code is not None
        code = 128 - code if code < 0 else code
        if self.kubelet.processes.get(self.name) == self.proc.pid:
            del self.kubelet.processes[self.name]
        await self._reap(signal.SIGKILL)  # what is left of the container's processes
        if self.removed or self.abandoned:
            return None
        ended = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "startedAt": self.started_at,
                 "finishedAt": now(), "containerID": f"fake://{self.uid[:8]}-{len(self.runs)}"}  # fmt: skip
        self._last = {"terminated": ended}
        self.started = self.ready = False
        return code

    async def _supervise(self) -> None:
        """Wait for the process to end; stop it when the pod is deleted (SIGTERM, SIGKILL after
        the grace period, in real seconds), when a probe or the kubelet says so, or at once when
        the pod is gone from the API or its node lost."""
        assert self.proc is not None
        loop = asyncio.get_running_loop()
        waiter = asyncio.ensure_future(self.proc.wait())
        term_at: float | None = None
        while not waiter.done():
            self.changed.clear()
            timeout = None
            if self.removed or self.abandoned or self.kill_reason == "evict":
                self._signal(signal.SIGKILL)
            elif self.terminating() or self.kill_reason:
                if term_at is None:
                    term_at = loop.time()
                    self._signal(signal.SIGTERM)
                    if self.terminating():  # a probe's kill has its own event
                        self._event("Killing", f"Stopping container {self.c['name']}")
                meta, probe = self.pod["metadata"], self.c.get(f"{self.kill_reason}Probe") or {}
                grace = meta.get("deletionGracePeriodSeconds") if self.terminating() else None
                if grace is None:
                    grace = probe.get(
                        "terminationGracePeriodSeconds",
                        self.pod["spec"].get("terminationGracePeriodSeconds", 30),
                    )
                timeout = term_at + grace - loop.time()
                if timeout <= 0:
                    self._signal(signal.SIGKILL)
                    timeout = None
            changed = asyncio.ensure_future(self.changed.wait())
            await asyncio.wait(
                {waiter, changed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            changed.cancel()

    def _signal(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    async def _reap(self, sig: int) -> None:
        """Signal the process group and wait for the process (used on any way out)."""
        if self.proc is not None:
            self._signal(sig)
            await self.proc.wait()

    # probes ---------------------------------------------------------------------------------

    async def _probe(self, kind: str, spec: Obj) -> None:
        scale, loop = self.kubelet.time_scale, asyncio.get_running_loop()
        began = loop.time()
        if kind != "startupProbe":
            await self.startup.wait()
        await asyncio.sleep(
            max(0.0, began + spec.get("initialDelaySeconds", 0) * scale - loop.time())
        )
        good = bad = 0
        while True:
            ok, why = await check(self.kubelet.http, spec, self.ip, self.pod, self.c)
            good, bad = (good + 1, 0) if ok else (0, bad + 1)
            label = kind.removesuffix("Probe").capitalize()
            if not ok:
                self._event("Unhealthy", f"{label} probe failed: {why}", "Warning")
            if kind == "startupProbe" and good >= spec["successThreshold"]:
                self.started = True
                self.startup.set()
                self._running()
                return
            if (
                kind == "readinessProbe"
                and self.ready != ok
                and (good >= spec["successThreshold"] or bad >= spec["failureThreshold"])
            ):
                self.ready = ok
                self._running()
            if kind != "readinessProbe" and bad >= spec["failureThreshold"]:
                self._event(
                    "Killing",
                    f"Container {self.c['name']} failed {label.lower()} probe, will be restarted",
                )
                self.kill_reason = kind.removesuffix("Probe")
                self.changed.set()
                return
            await asyncio.sleep(spec["periodSeconds"] * scale)
