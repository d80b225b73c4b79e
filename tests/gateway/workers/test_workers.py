"""``serve --workers 2`` as real processes: a worker killed mid-stream ends only its own
streams, their charges are settled as cut requests and the worker is replaced; a stopping
gateway drains every worker. And the line's own bounds. Real processes throughout (the gateway,
its workers, the launchable fake engine)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from capyctl_gateway import GatewayConfig
from capyctl_gateway._config import ConfigError
from capyctl_gateway._config.bounds import Limits, fit_workers, shared_bounds
from capyctl_gateway._workers.messages import FROZEN_S, Gone, Ready
from capyctl_gateway._workers.wire import MAX_MESSAGE_BYTES, Wire
from capyctl_gateway._workers.worker import share
from tests.eventually import eventually
from tests.gateway.conftest import Gw, deployments
from tests.gateway.deployments.test_operator import free_port
from tests.gateway.fake_engine import FakeEngine, Hold, vllm_stream
from tests.gateway.lifecycle.test_lifecycle import launched
from tests.gateway.lifecycle.test_lifecycle_races import said, served
from tests.gateway.serving import listening, serve_command

pytestmark = pytest.mark.anyio
STREAMS = 16


def children(pid: int) -> list[int]:
    """The live worker processes of gateway ``pid``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == pid and stat[0] != "Z" and b"capyctl_gateway._cli_workers" in argv:
            found.append(int(proc.name))
    return found


def holding(pid: int, port: int) -> int:
    """The established connections to local ``port`` that process ``pid`` holds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    held = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()  # local address, state (01: established) and inode
            local, state, inode = fields[1], fields[3], fields[9]
            held += state == "01" and int(local.rsplit(":", 1)[1], 16) == port and inode in inodes
    return held


async def stream(port: int, key: str, seconds: float, begun: asyncio.Event) -> str:
    """One streamed request on a connection of its own; what became of it: ``done``,
    ``broken`` (the connection ended mid-stream), or ``error`` (an in-band error event)."""
    body = {**said(f"take:{seconds}", "my-model"), "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    last = ""
    try:
        async with (
            httpx.AsyncClient(timeout=60, headers=headers) as c,
            c.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r,
        ):
            assert r.status_code == 200
            async for text in r.aiter_lines():
                if text.startswith("data:"):
                    last = text
                    begun.set()
    except httpx.RemoteProtocolError:
        return "broken"
    if last == "data: [DONE]":
        return "done"
    return "error" if '"error"' in last else "broken"


def start(
    tmp_path: Path,
    dep: dict[str, Any] | None = None,
    queue: dict[str, Any] | None = None,
    **limits: Any,
) -> tuple[subprocess.Popen[bytes], int, int, Path]:
    """``serve --workers 2`` for ``dep`` (a launched engine by default), with ``limits``."""
    config = tmp_path / "g.yaml"
    dep = dep or launched(served=served("w"), memory={"ready": "1GiB", "parked": 0})
    doc = {"limits": limits, "queue": queue or {}, "deployments": [dep]}
    config.write_text(yaml.safe_dump(doc))
    state, port, mport = tmp_path / "state", free_port(), free_port()
    argv, env = serve_command(config, state, port, mport)
    gateway = subprocess.Popen([*argv, "--workers", "2"], stderr=subprocess.PIPE, env=env)
    return gateway, port, mport, state


async def test_a_killed_worker_ends_only_its_streams_settles_them_and_is_replaced(
    tmp_path: Path,
) -> None:
    gateway, port, mport, state = start(tmp_path)
    try:
        key = listening(gateway, state)
        assert len(children(gateway.pid)) == 2
        begun = [asyncio.Event() for _ in range(STREAMS)]
        tasks = [asyncio.ensure_future(stream(port, key, 3, b)) for b in begun]
        for b in begun:
            await b.wait()  # every stream runs on the engine
        victim = children(gateway.pid)[0]
        os.kill(victim, signal.SIGKILL)
        ends = await asyncio.gather(*tasks)
        broken, done = ends.count("broken"), ends.count("done")
        # Each worker held some of 16 connections (SO_REUSEPORT); the other's streams ended well.
        assert broken + done == STREAMS and broken > 0 and done > 0, ends
        await eventually(
            lambda: len(children(gateway.pid)) == 2 and victim not in children(gateway.pid)
        )
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(timeout=60, headers=headers) as m:
            status = f"http://127.0.0.1:{mport}/management/v1/deployments/my-model"

            async def settled_count() -> float:
                metrics = (await m.get(f"http://127.0.0.1:{mport}/metrics")).text
                return _sum(metrics, "capyctl_cut_settled_total")

            async def charged() -> tuple[list[Any], Any, float] | None:
                """The cut requests, the status and the settled count, read while none
                settled (one may settle between two reads, at the engine's idle report)."""
                before = await settled_count()
                doc = (await m.get(status)).json()
                cut = [c for c in doc["instances"][0]["cancelled"] if "worker" in c["reason"]]
                return (cut, doc, before) if await settled_count() == before else None

            cut, doc, settled = await eventually(charged)
            # Every stream of the killed worker is charged as a cut request, or already settled.
            assert len(cut) + settled == broken, (cut, settled)
            assert doc["deployment"]["running"] == 0  # no slot was stranded
            # The replacement serves, and the whole gateway's counts are in one exposition.
            for _ in range(8):
                r = await m.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions", json=said("hi", "my-model")
                )
                assert r.status_code == 200, r.text

            async def completed() -> float | None:
                metrics = (await m.get(f"http://127.0.0.1:{mport}/metrics")).text
                n = _sum(metrics, 'capyctl_requests_total{api="chat"', 'outcome="completed"')
                return n if n >= done + 8 else None

            # A worker sends a request's counts once it has answered it: they may reach the
            # authority just after the client has its answer (docs/scaling.md).
            assert await eventually(completed) == done + 8
    finally:
        gateway.send_signal(signal.SIGTERM)
        code = gateway.wait(timeout=60)
        assert gateway.stderr is not None
        gateway.stderr.close()
    assert code == 0
    assert children(gateway.pid) == []


async def test_a_killed_workers_answered_streams_settle_as_answered_ones(
    tmp_path: Path, engine: FakeEngine
) -> None:
    """A worker killed while its streams from a ``url:`` engine had answered: the authority
    never heard that they had, so each was charged as cut before the engine answered, which
    settles only at the engine's next stop or restart: for good, on an engine someone else runs
    (issue 34, item 6). The worker says when output starts; they settle at the engine's first
    idle report after the cut, as in one process."""
    engine.script = [*vllm_stream(("Hel",))[:2], Hold()]
    gateway, port, mport, state = start(tmp_path, deployments(engine.url))
    tasks: list[asyncio.Future[None]] = []
    try:
        key = listening(gateway, state)
        begun = [asyncio.Event() for _ in range(8)]
        tasks += [asyncio.ensure_future(held(port, key, b)) for b in begun]
        for b in begun:
            await b.wait()  # every stream has its first text
        # The kernel shares the connections out (SO_REUSEPORT): all 8 may be one worker's.
        victim = max(children(gateway.pid), key=lambda w: holding(w, port))
        assert holding(victim, port) > 0
        os.kill(victim, signal.SIGKILL)
        await eventually(lambda: sum(t.done() for t in tasks) >= 1)
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(timeout=60, headers=headers) as m:

            async def settled() -> float | None:
                metrics = (await m.get(f"http://127.0.0.1:{mport}/metrics")).text
                doc = (
                    await m.get(f"http://127.0.0.1:{mport}/management/v1/deployments/my-model")
                ).json()
                left = [c for c in doc["instances"][0]["cancelled"] if "worker" in c["reason"]]
                count = _sum(metrics, "capyctl_cut_settled_total")
                return count if not left and count else None

            assert await eventually(settled) == sum(t.done() for t in tasks)
    finally:
        for t in tasks:
            t.cancel()  # the survivor's streams, held by the engine, would hold its drain
        await asyncio.gather(*tasks, return_exceptions=True)
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(timeout=60)
        assert gateway.stderr is not None
        gateway.stderr.close()


async def held(port: int, key: str, begun: asyncio.Event) -> None:
    """A stream whose engine holds it after its first text; it ends when its worker dies."""
    body = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    with contextlib.suppress(httpx.HTTPError):
        async with (
            httpx.AsyncClient(timeout=60, headers=headers) as c,
            c.stream("POST", url, json=body) as r,
        ):
            async for line in r.aiter_lines():
                if '"Hel"' in line:
                    begun.set()


async def one(port: int, key: str) -> tuple[int | str, float]:
    """One chat request on a connection of its own: its status (or the error that ended it)
    and how long it took."""
    began = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with httpx.AsyncClient(timeout=40, headers=headers) as c:
            r = await c.post(
                f"http://127.0.0.1:{port}/v1/chat/completions", json=said("hi", "my-model")
            )
        return r.status_code, time.monotonic() - began
    except httpx.HTTPError as exc:
        return type(exc).__name__, time.monotonic() - began


async def test_a_frozen_worker_is_replaced_and_no_client_waits_on_it(tmp_path: Path) -> None:
    """A worker stopped (SIGSTOP) kept its share of the port: the requests the kernel gave it
    got no answer, and nothing replaced it (issue 34, item 5). It answers no ping: after
    FROZEN_S it is killed, its clients' connections end, and a new worker serves."""
    gateway, port, mport, state = start(tmp_path)
    try:
        key = listening(gateway, state)
        assert (await one(port, key))[0] == 200
        frozen = children(gateway.pid)[0]
        os.kill(frozen, signal.SIGSTOP)
        ends = await asyncio.gather(*(one(port, key) for _ in range(12)))
        # Each ended: answered by the other worker, or its connection ended when the frozen
        # one was killed, well before the clients' own 40 s.
        assert all(took < FROZEN_S + 10 for _, took in ends), ends
        assert any(status == 200 for status, _ in ends), ends
        await eventually(
            lambda: frozen not in children(gateway.pid) and len(children(gateway.pid)) == 2
        )
        again = await asyncio.gather(*(one(port, key) for _ in range(12)))
        assert [status for status, _ in again] == [200] * 12, again
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGCONT)
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(timeout=60)
        assert gateway.stderr is not None
        with gateway.stderr:
            assert b"worker_frozen" in gateway.stderr.read()


async def test_with_its_authority_frozen_a_worker_answers_by_the_deadline(
    tmp_path: Path,
) -> None:
    """The authority stopped (SIGSTOP): requests with a 2 s deadline waited for it and were
    answered 20 s later (issue 34, item 5). A worker holds the deadline itself: 503 at it; once
    the authority has been silent for FROZEN_S, at once; and all is well when it wakes."""
    gateway, port, _, state = start(tmp_path, queue={"request_deadline": "2s"})
    try:
        key = listening(gateway, state)
        assert (await one(port, key))[0] == 200
        workers = sorted(children(gateway.pid))
        os.kill(gateway.pid, signal.SIGSTOP)
        try:
            first = await asyncio.gather(*(one(port, key) for _ in range(6)))
            assert all(s == 503 and 2 <= t < 4 for s, t in first), first

            async def shed_at_once() -> tuple[int | str, float] | None:
                got = await one(port, key)
                return got if got[1] < 1 else None

            shed = await eventually(shed_at_once, within=FROZEN_S + 10)
            assert shed[0] == 503, shed
        finally:
            os.kill(gateway.pid, signal.SIGCONT)

        async def served() -> tuple[int | str, float] | None:
            got = await one(port, key)
            return got if got[0] == 200 else None

        await eventually(served)  # its next ping tells the workers it is back
        woke = await asyncio.gather(*(one(port, key) for _ in range(6)))
        assert [s for s, _ in woke] == [200] * 6, woke
        # Its own stall was no worker's silence: the same workers serve (none was killed).
        assert sorted(children(gateway.pid)) == workers
    finally:
        gateway.send_signal(signal.SIGCONT)
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(timeout=60)
        assert gateway.stderr is not None
        with gateway.stderr:
            assert b"worker_frozen" not in gateway.stderr.read()


async def test_a_stopping_gateway_drains_every_worker(tmp_path: Path) -> None:
    gateway, port, _, state = start(tmp_path, shutdown_timeout="20s")
    try:
        key = listening(gateway, state)
        workers = children(gateway.pid)
        begun = [asyncio.Event() for _ in range(8)]
        tasks = [asyncio.ensure_future(stream(port, key, 1.5, b)) for b in begun]
        for b in begun:
            await b.wait()
        gateway.send_signal(signal.SIGTERM)
        assert await asyncio.gather(*tasks) == ["done"] * 8  # each finished within the timeout
        assert await asyncio.to_thread(gateway.wait, 60) == 0
    finally:
        if gateway.poll() is None:
            gateway.kill()
    assert gateway.stderr is not None
    with gateway.stderr:
        assert b"capyctl-gateway: stopped" in gateway.stderr.read()
    assert not any(map(alive, workers))


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _sum(text: str, *parts: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if all(p in line for p in parts) and not line.startswith("#")
    )


def test_each_worker_holds_its_share_of_the_listeners_bounds() -> None:
    assert share(2048, 2) == 1024 and share(5, 2) == 3 and share(1, 4) == 1
    # the bounds shared are the fields marked so, not a list kept beside them
    assert shared_bounds(Limits) == ("max_body_bytes_in_flight", "max_connections")
    assert GatewayConfig.model_validate({"workers": 64, "deployments": [launched()]}).workers == 64
    with pytest.raises(ValueError, match="workers"):
        GatewayConfig.model_validate({"workers": 65, "deployments": [launched()]})


def test_a_body_budget_that_cannot_hold_a_body_within_the_limits_is_refused_at_load() -> None:
    """Each worker's share of the body budget was the total split evenly, never compared with
    the largest body: from 5 workers a 52 MiB chat body got a 503 saying to retry, for ever.
    Left at its default, the budget grows so that a share holds that body; set too small, it
    is refused when the configuration is read (one process) or by serve (workers)."""
    mib = 2**20
    assert fit_workers(Limits(), 4).max_body_bytes_in_flight == 256 * mib  # 64 MiB each
    assert fit_workers(Limits(), 5).max_body_bytes_in_flight == 5 * 64 * mib
    assert Limits(max_body_bytes=512 * mib).max_body_bytes_in_flight == 512 * mib
    with pytest.raises(ConfigError, match="split over 5 workers"):
        fit_workers(Limits(max_body_bytes_in_flight=256 * mib), 5)
    with pytest.raises(ValueError, match="could never be read"):
        Limits(max_body_bytes_in_flight=32 * mib)


@pytest.mark.parametrize("workers", [5])
async def test_with_five_workers_a_body_within_every_limit_is_served(
    make_gateway: Callable[..., Awaitable[Gw]], engine: FakeEngine, workers: int
) -> None:
    engine.script = vllm_stream()
    gw = await make_gateway({"deployments": [deployments(engine.url)]})
    text = "x" * (60 * 2**20)  # under the 64 MiB chat limit, over a fifth of 256 MiB
    body = {"model": "my-model", "messages": [{"role": "user", "content": text}]}
    async with gw.client(timeout=120) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text[:300]
    assert len(engine.received) == 1


async def test_a_message_past_the_lines_bound_closes_the_line() -> None:
    got: list[Any] = []
    lost: list[bool] = []
    wire = Wire(got.append, lambda: lost.append(True))
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    await loop.create_unix_connection(lambda: wire, sock=ours)
    theirs.sendall(b'\x00\x00\x00\x05["R"]' + (MAX_MESSAGE_BYTES + 1).to_bytes(4, "big"))
    await eventually(lambda: lost == [True], within=5)
    assert got == [Ready()]
    assert theirs.recv(10) == b""  # the line really closed on our side
    theirs.close()


@pytest.mark.parametrize(
    "sent",
    [b"[1,2]", b'["Z",1]', b'["E",1,true]', b"{}", b"not json"],
    ids=["no tag", "unknown tag", "short", "not an array", "not json"],
)
async def test_a_message_that_is_not_one_closes_the_line(sent: bytes) -> None:
    got: list[Any] = []
    lost: list[bool] = []
    wire = Wire(got.append, lambda: lost.append(True))
    ours, theirs = socket.socketpair()
    await asyncio.get_running_loop().create_unix_connection(lambda: wire, sock=ours)
    good = b'["C",7]'
    theirs.sendall(len(good).to_bytes(4, "big") + good + len(sent).to_bytes(4, "big") + sent)
    await eventually(lambda: lost == [True], within=5)
    assert got == [Gone(7)]  # the one before it was taken; nothing after it
    assert theirs.recv(10) == b""
    theirs.close()
