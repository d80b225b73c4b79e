"""The fault soak: randomized hang-ups in every phase and engine faults, against a real
``capyctl-gateway`` process in front of a fault-injecting engine (``bench.perf.fault_engine``),
both started as ``bench.perf.soak`` starts its own, on loopback.

N requests (default 2,000; ``--quick`` 200) at concurrency C (default 64), each with a plan drawn
from a seeded generator (``--seed``; every kind of plan occurs at least once when N allows):

* streamed or not;
* when the client hangs up: never (``none``), while sending the body (``body``), while queued
  (``queued``: a few ms after sending, the gateway's running slots being full), before the first
  token (``first_token``: on the role chunk of a slow stream, or once a silent engine has the
  request), mid-stream (``mid_stream``: after k content chunks, or while the engine only pings),
  or, not streamed, while the engine works (``working``: once the engine has the request);
* what the engine does (its ``user`` field): ``normal``, ``slow`` (late first token), ``hang``
  (never a byte), ``die`` (a few chunks, then a TCP reset), ``pings`` (one token, then only
  ``: ping`` comments).

Every request is classified: **served** (complete, ``[DONE]`` on a stream, the content as the
engine sent it), a **documented error** (an HTTP 4xx/5xx JSON answer with a documented status and
code, or one in-band ``data: {"error": ...}`` event ending a stream), a deliberate **hang-up**, or
**lost** (anything else: a connection closed or reset without an answer, no answer within the
client's timeout, wrong content, an undocumented status or code such as a 500).

The gateway runs with small timeouts so that faults resolve fast: ``queue.request_deadline``
3 s, ``stream_idle_timeout`` 1 s, ``max_running_per_deployment`` 16 (``--max-running``), which
keeps most of the 64 concurrent requests waiting in its queue, and room for all of them to wait.
After the load the soak waits for the gateway's pooled engine connections to expire (kept idle
4 s), then checks at the engine that no connection that carried a chat request is still open,
that nothing is still in progress there, that every request that reached it ended (finished,
closed by the gateway, or aborted by the engine), that each reached it once, and that the counts
add up. It reads the gateway's RSS and open file descriptors from ``/proc`` before and after, and
its management status (the cut requests it still counts against the instance) after the load,
after the idle wait, and after the engine's process start marker moves (a restart).

Run from the repository root: ``.venv/bin/python -m bench.perf.faults [--quick] [--json FILE]
[--requests N] [--concurrency C] [--seed S]`` (about a minute; ``--quick`` ~20 s). It prints a
markdown report, exits 1 when a request was lost or the engine was left with a connection or a
request open (or its counts do not add up), and stops everything it started, by process group,
however it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from ._procfs import cpu_seconds, peak_rss_kib, rss_kib
from ._procs import Proc, ProcessSet, StartupError, free_port
from .fault_engine import MODES, content_text
from .run import _check_target, _machine, _terminate, start_gateway
from .soak import _raise_nofile, _run_async, fd_count

__all__ = ["PHASES", "Plan", "main", "make_plans"]

PHASES = ("none", "body", "queued", "first_token", "mid_stream", "working")
DEPLOYMENT = "bench"
IDLE_CONNECTION_S = 4.0
"""How long the gateway keeps an idle engine connection pooled (``_engine_client.IDLE_S``)."""

# Every (phase, engine mode, streamed) a plan may take.
COMBOS: tuple[tuple[str, str, bool], ...] = (
    *(("none", m, s) for m in MODES for s in (True, False)),
    ("body", "normal", True),
    ("body", "normal", False),
    ("queued", "normal", True),
    ("queued", "normal", False),
    ("first_token", "slow", True),
    ("first_token", "hang", True),
    ("mid_stream", "normal", True),
    ("mid_stream", "pings", True),
    ("working", "slow", False),
    ("working", "normal", False),
    ("working", "hang", False),
    ("working", "pings", False),
)
PHASE_WEIGHTS = {
    "none": 40,
    "body": 5,
    "queued": 14,
    "first_token": 14,
    "mid_stream": 14,
    "working": 13,
}
NONE_MODE_WEIGHTS = {"normal": 50, "slow": 15, "hang": 10, "die": 12, "pings": 13}

# What docs/gateway/README.md documents: (status, code) of an HTTP error answer ...
DOCUMENTED_HTTP = frozenset(
    {
        (401, "unauthorized"),
        (413, "request_too_large"),
        (400, "invalid_request"),
        (404, "unknown_model"),
        (400, "api_mismatch"),
        (400, "unsupported_parameter"),
        (400, "cache_salt_unsupported"),
        (400, "engine_rejected"),
        (413, "engine_rejected"),
        (422, "engine_rejected"),
        (502, "engine_error"),
        (503, "unavailable"),
        (408, "request_timeout"),
        (429, "queue_full"),
    }
)
# ... and the codes of an in-band error event ending a stream.
DOCUMENTED_IN_BAND = frozenset({code for _, code in DOCUMENTED_HTTP} | {"stream_unverified"})
CATEGORIES = ("served", "http_error", "inband_error", "hung_up", "lost")


# -- plans ------------------------------------------------------------------------------------
@dataclass(slots=True)
class Plan:
    """One request: when the client hangs up (``phase``) and what the engine does (``mode``)."""

    rid: int
    phase: str
    mode: str
    stream: bool
    chunks: int = 4
    gap_ms: float = 0.0
    ttft_ms: float = 0.0
    die_after: int = 1
    ping_ms: float = 200.0
    hangup_ms: float = 0.0
    """The hang-up's delay after its trigger (sending, the role chunk, the engine's arrival)."""
    hangup_at_chunk: int = 0
    """mid_stream: hang up once this many content chunks have arrived."""
    abort: bool = False
    """Hang up with a reset (SO_LINGER 0) rather than a FIN."""

    @property
    def kind(self) -> str:
        return f"{self.phase}/{self.mode}/{'stream' if self.stream else 'json'}"

    def user(self) -> str:
        return (
            f"id={self.rid};mode={self.mode};chunks={self.chunks};gap_ms={self.gap_ms:g};"
            f"ttft_ms={self.ttft_ms:g};die_after={self.die_after};ping_ms={self.ping_ms:g}"
        )

    def expected_content(self) -> str:
        return "".join(content_text(i) for i in range(self.chunks))

    @property
    def fault(self) -> bool:
        """The engine misbehaves on this request."""
        return self.mode in ("hang", "die", "pings")


def _plan(rng: random.Random, rid: int, phase: str, mode: str, stream: bool) -> Plan:
    p = Plan(rid, phase, mode, stream, abort=rng.random() < 0.3)
    if phase == "none":
        if mode == "normal":
            p.chunks, p.gap_ms = rng.randint(1, 24), rng.choice((0, 0, 1, 2, 5))
        elif mode == "slow":
            p.chunks, p.gap_ms = rng.randint(1, 12), rng.choice((0, 1, 3))
            p.ttft_ms = rng.randint(100, 800)
        elif mode == "die":
            p.die_after = rng.randint(0, 3)
            p.chunks, p.gap_ms = p.die_after + 4, rng.choice((0, 1, 2))
        elif mode == "pings":
            p.chunks, p.ping_ms = 1, rng.randint(100, 300)
    elif phase == "body":
        p.hangup_ms = rng.randint(0, 40)
    elif phase == "queued":
        p.chunks, p.hangup_ms = rng.randint(4, 16), rng.randint(2, 60)
    elif phase == "first_token":
        p.hangup_ms = rng.randint(0, 50)
        if mode == "slow":
            p.ttft_ms, p.chunks = rng.randint(1500, 2500), 4
    elif phase == "mid_stream":
        if mode == "normal":
            p.chunks, p.gap_ms = rng.randint(10, 40), rng.randint(5, 15)
            p.hangup_at_chunk = rng.randint(1, p.chunks - 1)
        else:  # pings: hang up while the engine only pings, before the idle timeout
            p.chunks, p.ping_ms = 1, rng.randint(100, 200)
            p.hangup_at_chunk, p.hangup_ms = 1, rng.randint(0, 300)
    elif phase == "working":
        p.hangup_ms = rng.randint(0, 150)
        if mode == "slow":
            p.ttft_ms, p.chunks = rng.randint(1000, 2000), 4
        elif mode == "normal":
            p.chunks, p.gap_ms = rng.randint(30, 60), rng.randint(15, 25)
        elif mode == "pings":
            p.chunks, p.ping_ms = 1, rng.randint(100, 200)
    return p


def _weighted(rng: random.Random, weights: dict[str, int]) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def _kind(c: tuple[str, str, bool]) -> str:
    return f"{c[0]}/{c[1]}/{'stream' if c[2] else 'json'}"


def make_plans(n: int, seed: int, only: list[str] | None = None) -> list[Plan]:
    """``n`` plans drawn from ``seed``: one of each kind first (when ``n`` allows), the rest at
    random by the weights above, shuffled; ids 1..n in the order they are sent. ``only``: kinds
    (``phase/mode/stream|json``) or their prefixes, drawn uniformly instead (to reproduce)."""
    rng = random.Random(seed)
    kinds: list[tuple[str, str, bool]]
    if only:
        chosen = [c for c in COMBOS if any(_kind(c).startswith(o) for o in only)]
        if not chosen:
            raise ValueError(f"no plan kind starts with any of {only}")
        kinds = [rng.choice(chosen) for _ in range(n)]
        return [_plan(rng, i + 1, *k) for i, k in enumerate(kinds)]
    kinds = list(COMBOS) if n >= len(COMBOS) else []
    while len(kinds) < n:
        phase = _weighted(rng, PHASE_WEIGHTS)
        if phase == "none":
            kinds.append((phase, _weighted(rng, NONE_MODE_WEIGHTS), rng.random() < 0.5))
        else:
            kinds.append(rng.choice([c for c in COMBOS if c[0] == phase]))
    rng.shuffle(kinds)
    return [_plan(rng, i + 1, *k) for i, k in enumerate(kinds)]


# -- the client -------------------------------------------------------------------------------
@dataclass
class Ctx:
    host: str
    port: int
    key: str
    engine_port: int
    timeout_s: float
    arrival_timeout_s: float = 15.0


def _chat_request(ctx: Ctx, plan: Plan) -> tuple[bytes, int]:
    """The request's bytes, and where its body starts."""
    body: dict[str, Any] = {
        "model": DEPLOYMENT,
        "messages": [{"role": "user", "content": "fault soak"}],
        "max_tokens": plan.chunks,
        "user": plan.user(),
    }
    if plan.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    raw = orjson.dumps(body)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {ctx.host}:{ctx.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n"
        f"Authorization: Bearer {ctx.key}\r\nX-Request-Id: fault-{plan.rid}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    return head + raw, len(head)


@dataclass
class Exchange:
    """What the client has seen of one answer so far."""

    want_chunks: int = 1
    status: int | None = None
    sse: bool = False
    body: bytes = b""
    content: list[str] = field(default_factory=list)
    role: bool = False
    done: bool = False
    error: dict[str, Any] | None = None
    after_end: int = 0
    malformed: int = 0
    complete: bool = False
    bytes_read: int = 0
    role_seen: asyncio.Event = field(default_factory=asyncio.Event)
    chunks_seen: asyncio.Event = field(default_factory=asyncio.Event)

    def on_event(self, data: bytes) -> None:
        if self.done or self.error is not None:
            self.after_end += 1
            return
        if data == b"[DONE]":
            self.done = True
            return
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.malformed += 1
            return
        if not isinstance(obj, dict):
            self.malformed += 1
            return
        if "error" in obj:
            err = obj["error"]
            self.error = err if isinstance(err, dict) else {"code": None, "raw": err}
            return
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices:
            return  # the usage chunk
        delta = choices[0].get("delta") if isinstance(choices[0], dict) else None
        if not isinstance(delta, dict):
            self.malformed += 1
            return
        if delta.get("role"):
            self.role = True
            self.role_seen.set()
        text = delta.get("content")
        if isinstance(text, str) and text:
            self.content.append(text)
            if len(self.content) >= self.want_chunks:
                self.chunks_seen.set()


async def _read_answer(reader: asyncio.StreamReader, ex: Exchange) -> None:
    """Read one HTTP answer whole (to the end of its framing), feeding events to ``ex``."""
    head = await reader.readuntil(b"\r\n\r\n")
    ex.bytes_read += len(head)
    lines = head.decode("latin-1").split("\r\n")
    ex.status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    ex.sse = headers.get("content-type", "").startswith("text/event-stream")
    pending = b""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # no trailers: the empty line
                break
            data = (await reader.readexactly(size + 2))[:-2]
            ex.bytes_read += size
            if not ex.sse:
                ex.body += data
                continue
            pending += data
            *blocks, pending = pending.split(b"\n\n")
            for block in blocks:
                parts = [
                    ln[5:].lstrip(b" ") for ln in block.split(b"\n") if ln.startswith(b"data:")
                ]
                if parts:
                    ex.on_event(b"\n".join(parts))
        if pending.strip():
            ex.malformed += 1
    elif "content-length" in headers:
        ex.body = await reader.readexactly(int(headers["content-length"]))
        ex.bytes_read += len(ex.body)
    else:
        ex.body = await reader.read()
    ex.complete = True


async def _http_json(
    host: str,
    port: int,
    path: str,
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    timeout_s: float = 5.0,
) -> Any:
    """A small request over its own connection; the JSON answer (raises on anything else)."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    req = (
        f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{extra}"
        "Content-Length: 0\r\nConnection: close\r\n\r\n"
    ).encode()
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(req)
            ex = Exchange()
            await _read_answer(reader, ex)
        finally:
            writer.close()
    if ex.status != 200:
        raise ValueError(f"{path}: HTTP {ex.status} {ex.body[:200]!r}")
    return orjson.loads(ex.body)


async def _arrived(ctx: Ctx, rid: int) -> bool:
    """Whether the engine got request ``rid`` (a long poll on its debug route)."""
    path = f"/debug/arrived?id={rid}&timeout_s={ctx.arrival_timeout_s:g}"
    try:
        doc = await _http_json(
            "127.0.0.1", ctx.engine_port, path, timeout_s=ctx.arrival_timeout_s + 5
        )
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
        return False
    return bool(doc.get("arrived"))


async def _trigger(plan: Plan, ex: Exchange, arrival: asyncio.Task[bool] | None) -> bool:
    """Wait for the moment of the plan's hang-up; False if it never comes."""
    if plan.phase in ("first_token", "working") and arrival is not None:
        if not await arrival:
            return False
    elif plan.phase == "first_token":
        await ex.role_seen.wait()
    elif plan.phase == "mid_stream":
        await ex.chunks_seen.wait()
    await asyncio.sleep(plan.hangup_ms / 1000)
    return True


@dataclass
class Result:
    rid: int
    kind: str
    category: str
    label: str
    seconds: float
    detail: str | None = None
    at_engine: str | None = None
    """How the request ended at the engine: finished, closed, died, open (None: never got it)."""
    gateway_cut: str | None = None
    """Why the gateway says it cut the request short (its log); None: it did not."""


@dataclass
class GatewaySaw:
    """What the gateway's log says of one request (by its X-Request-Id)."""

    selections: int = 0
    cut: str | None = None


_CUT = re.compile(r"^request (\S+) cut \(([^)]*)\)")


def _gateway_log(path: Path) -> dict[int, GatewaySaw]:
    """Each plan's request as the gateway logged it: how often it was sent to an instance
    (``router_selection``) and the reason it gave for cutting it short, if it did."""
    by_rid: dict[str, int] = {}
    out: dict[int, GatewaySaw] = {}
    with contextlib.suppress(OSError), path.open("rb") as fh:
        for line in fh:
            try:
                ev = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(ev, dict):
                continue
            caller = ev.get("caller_request_id")
            if ev.get("event") == "router_selection" and isinstance(caller, str):
                if caller.startswith("fault-"):
                    rid = int(caller.removeprefix("fault-"))
                    by_rid[ev["capyctl_request_id"]] = rid
                    out.setdefault(rid, GatewaySaw()).selections += 1
                continue
            m = _CUT.match(str(ev.get("message", "")))
            if m is not None and m.group(1) in by_rid:
                out[by_rid[m.group(1)]].cut = m.group(2)
    return out


def _queue_deadline(r: Result) -> bool:
    """A documented 503: no running slot came free within the request deadline (load)."""
    return r.label == "HTTP 503 unavailable" and "no running slot" in (r.detail or "")


def _expected_cut(plan: Plan, r: Result) -> str | None:
    """The reason the gateway should give for cutting ``r`` short (None: no cut; "any": either
    way, as timing decides)."""
    if r.at_engine is None:
        # Never received. A client that hung up while the gateway was opening the engine
        # connection or sending leaves a request the gateway cannot know the engine missed.
        return "any" if r.category == "hung_up" else None
    if r.category == "hung_up":
        # The engine may have finished first (its connection then pooled, nothing cut).
        return "any" if r.at_engine == "finished" else "hang_up"
    if plan.mode == "die":
        return "engine stream broken"
    if plan.mode == "hang":
        return "deadline"
    if plan.mode == "pings":
        return "idle_timeout"
    if r.label in ("HTTP 503 unavailable", "in-band unavailable"):
        return "deadline"  # a slow first token after a long wait in the queue
    return None


def _hang_up(writer: asyncio.StreamWriter, abort: bool) -> None:
    """Close the connection: with a FIN, or (``abort``) with a reset."""
    if abort:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        writer.close()


async def run_one(ctx: Ctx, plan: Plan) -> Result:
    """Send one request as its plan says; classify what came back."""
    t0 = time.monotonic()
    ex = Exchange(want_chunks=max(1, plan.hangup_at_chunk))
    request, body_at = _chat_request(ctx, plan)
    hung_up = False
    failure: str | None = None
    tasks: list[asyncio.Task[Any]] = []
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(ctx.timeout_s):
            arrival = None
            if plan.phase == "working" or (plan.phase == "first_token" and plan.mode == "hang"):
                arrival = asyncio.create_task(_arrived(ctx, plan.rid))
                tasks.append(arrival)
            reader, writer = await asyncio.open_connection(ctx.host, ctx.port)
            if plan.phase == "body":  # the head and half the body: the rest never comes
                writer.write(request[: body_at + (len(request) - body_at) // 2])
            else:
                writer.write(request)
            read = asyncio.create_task(_read_answer(reader, ex))
            tasks.append(read)
            if plan.phase == "none":
                await read
            else:
                trigger = asyncio.create_task(_trigger(plan, ex, arrival))
                tasks.append(trigger)
                done, _ = await asyncio.wait({read, trigger}, return_when=asyncio.FIRST_COMPLETED)
                if read in done:
                    read.result()
                elif trigger.result() and not read.done():
                    hung_up = True
                    read.cancel()
                    _hang_up(writer, plan.abort)
                else:
                    await read
    except TimeoutError:
        failure = f"no whole answer within {ctx.timeout_s:g} s"
    except asyncio.IncompleteReadError as exc:
        failure = f"connection closed after {ex.bytes_read + len(exc.partial)} bytes of the answer"
    except (OSError, ValueError, asyncio.LimitOverrunError) as exc:
        failure = f"{type(exc).__name__}: {exc} after {ex.bytes_read} bytes of the answer"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if writer is not None and not writer.transport.is_closing():
            writer.close()
    seconds = round(time.monotonic() - t0, 3)
    category, label, detail = _classify(plan, ex, hung_up=hung_up, failure=failure)
    return Result(plan.rid, plan.kind, category, label, seconds, detail)


def _classify(
    plan: Plan, ex: Exchange, *, hung_up: bool, failure: str | None
) -> tuple[str, str, str | None]:
    if hung_up:
        seen = f"{len(ex.content)} content chunks" if ex.status is not None else "nothing"
        return "hung_up", "hung up", f"the client hung up ({plan.phase}) having seen {seen}"
    if failure is not None:
        return "lost", "LOST", failure
    if ex.status == 200 and ex.sse != plan.stream:
        return "lost", "LOST", f"a {'stream' if ex.sse else 'JSON answer'} for this request"
    if ex.status == 200 and ex.sse:
        if ex.malformed or ex.after_end:
            why = f"{ex.malformed} malformed events, {ex.after_end} events after the end"
            return "lost", "LOST", why
        if ex.error is not None:
            code = ex.error.get("code")
            if code in DOCUMENTED_IN_BAND:
                return "inband_error", f"in-band {code}", str(ex.error.get("message"))
            return "lost", "LOST", f"undocumented in-band error {ex.error!r}"
        if not ex.done:
            return "lost", "LOST", "a stream that ended without [DONE] or an error event"
        got = "".join(ex.content)
        if got != plan.expected_content():
            return "lost", "LOST", f"wrong content {got[:80]!r}"
        return "served", "served", None
    try:
        doc = orjson.loads(ex.body)
    except orjson.JSONDecodeError:
        return "lost", "LOST", f"HTTP {ex.status}, not JSON: {ex.body[:120]!r}"
    if not isinstance(doc, dict):
        return "lost", "LOST", f"HTTP {ex.status}: {ex.body[:120]!r}"
    if ex.status == 200:
        try:
            got = doc["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            return "lost", "LOST", f"HTTP 200, not a chat.completion: {ex.body[:120]!r}"
        if doc.get("object") != "chat.completion" or got != plan.expected_content():
            return "lost", "LOST", f"wrong content {str(got)[:80]!r}"
        return "served", "served", None
    code = doc.get("code")
    if (ex.status, code) in DOCUMENTED_HTTP:
        return "http_error", f"HTTP {ex.status} {code}", str(doc.get("message"))
    return "lost", "LOST", f"undocumented answer HTTP {ex.status}: {ex.body[:200]!r}"


# -- the run ----------------------------------------------------------------------------------
@dataclass
class Served:
    engine: Proc
    gateway: Proc
    ctx: Ctx
    management: tuple[str, int]


def _gateway_config(args: argparse.Namespace) -> str:
    waiting = max(256, 2 * args.concurrency)
    return (
        "queue:\n"
        f"  request_deadline: {args.deadline_s:g}s\n"
        f"  stream_idle_timeout: {args.idle_s:g}s\n"
        f"  max_running_per_deployment: {args.max_running}\n"
        f"  max_waiting_per_deployment: {waiting}\n"
        f"  max_waiting_total: {waiting}\n"
    )


def _management_addr(pid: int) -> tuple[str, int]:
    """The gateway's ``--management HOST:PORT``, from its command line (run.start_gateway
    chooses the port and does not return it)."""
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        argv = fh.read().decode().split("\0")
    addr = argv[argv.index("--management") + 1]
    host, _, port = addr.rpartition(":")
    return host, int(port)


def _serve(args: argparse.Namespace, procs: ProcessSet, work: Path) -> Served:
    eport = free_port()
    engine = procs.start(
        "engine",
        [sys.executable, "-m", "bench.perf.fault_engine", "--port", str(eport), "--served", "tiny"],
    )
    engine.wait_http(f"http://127.0.0.1:{eport}/health")
    gateway, target = start_gateway(
        procs, work, f"http://127.0.0.1:{eport}", extra=_gateway_config(args)
    )
    _check_target(target, stream=True)
    _check_target(target, stream=False)
    parts = urlsplit(target.url)
    ctx = Ctx(
        parts.hostname or "127.0.0.1",
        parts.port or 80,
        target.key or "",
        eport,
        timeout_s=args.client_timeout_s,
    )
    return Served(engine, gateway, ctx, _management_addr(gateway.pid))


def _mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


async def _engine_counts(sv: Served) -> dict[str, Any]:
    doc: dict[str, Any] = await _http_json("127.0.0.1", sv.ctx.engine_port, "/debug/counts")
    return doc


async def _status(sv: Served) -> dict[str, Any] | None:
    host, port = sv.management
    auth = {"Authorization": f"Bearer {sv.ctx.key}"}
    try:
        doc: dict[str, Any] = await _http_json(
            host, port, f"/management/v1/deployments/{DEPLOYMENT}", headers=auth
        )
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
        return None
    return doc


def _cut_summary(status: dict[str, Any] | None) -> dict[str, Any]:
    if status is None:
        return {"available": False}
    inst = status["instances"]
    cut = [c for i in inst for c in i["cancelled"]]
    return {
        "available": True,
        "deployment_running": status["deployment"]["running"],
        "deployment_waiting": status["deployment"]["waiting"],
        "router_running": sum(i["router_running"] for i in inst),
        "engine_running": [i["running"] for i in inst],
        "state": [i["state"] for i in inst],
        "cut_still_counted": len(cut),
        "by_settle_rule": dict(Counter(c["settles"] for c in cut)),
        "by_reason": dict(Counter(c["reason"] for c in cut)),
    }


async def _soak(
    args: argparse.Namespace, sv: Served, plans: list[Plan], log: Callable[[str], None]
) -> dict[str, Any]:
    pid = sv.gateway.pid
    await asyncio.sleep(1.0)  # the collector's first polls
    before = {"rss_mib": _mib(rss_kib(pid)), "fds": fd_count(pid)}
    counts_before = await _engine_counts(sv)
    peaks = {"gateway_waiting": 0, "gateway_running": 0, "engine_in_progress": 0, "fds": 0}
    rss_peak = 0.0
    stop = asyncio.Event()

    async def sampler() -> None:
        nonlocal rss_peak
        while not stop.is_set():
            status = await _status(sv)
            if status is not None:
                d = status["deployment"]
                peaks["gateway_waiting"] = max(peaks["gateway_waiting"], d["waiting"])
                peaks["gateway_running"] = max(peaks["gateway_running"], d["running"])
            with contextlib.suppress(OSError, TimeoutError, ValueError):
                c = await _engine_counts(sv)
                peaks["engine_in_progress"] = max(peaks["engine_in_progress"], c["in_progress"])
            peaks["fds"] = max(peaks["fds"], fd_count(pid) or 0)
            rss_peak = max(rss_peak, _mib(rss_kib(pid)) or 0.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    results: list[Result | None] = [None] * len(plans)
    order = iter(range(len(plans)))
    finished = 0
    step = max(1, len(plans) // 10)

    async def worker() -> None:
        nonlocal finished
        for i in order:
            results[i] = await run_one(sv.ctx, plans[i])
            finished += 1
            if finished % step == 0:
                lost = sum(1 for r in results if r is not None and r.category == "lost")
                log(f"faults: {finished:>6,}/{len(plans):,} requests, lost {lost}")

    sampling = asyncio.create_task(sampler())
    cpu0, w0 = cpu_seconds([pid]), time.monotonic()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    load_s = time.monotonic() - w0
    cpu = cpu_seconds([pid]) - cpu0
    stop.set()
    await sampling
    done = [r for r in results if r is not None]

    # Right after the load, then once the pooled engine connections have expired.
    status_end = await _status(sv)
    t_end = time.monotonic()
    counts = await _engine_counts(sv)
    while (counts["open_chat_connections"] or counts["in_progress"]) and (
        time.monotonic() - t_end < args.settle_s
    ):
        await asyncio.sleep(0.5)
        counts = await _engine_counts(sv)
    settled_s = round(time.monotonic() - t_end, 1)
    await asyncio.sleep(1.0)  # the collector's next samples settle what the idle engine shows
    counts = await _engine_counts(sv)
    status_idle = await _status(sv)
    after = {"rss_mib": _mib(rss_kib(pid)), "fds": fd_count(pid)}
    seen = await _http_json("127.0.0.1", sv.ctx.engine_port, "/debug/requests", timeout_s=20)
    alive = {p.name: p.popen.poll() is None for p in (sv.engine, sv.gateway)}

    # A restart marker settles what is charged until the engine's next stop or restart.
    restart_waited = 0.0
    status_restart = status_idle
    if status_idle is not None and _cut_summary(status_idle)["cut_still_counted"]:
        await _http_json("127.0.0.1", sv.ctx.engine_port, "/debug/restart", method="POST")
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.restart_wait_s:
            await asyncio.sleep(0.25)
            status_restart = await _status(sv)
            if status_restart is not None and not _cut_summary(status_restart)["cut_still_counted"]:
                break
        restart_waited = round(time.monotonic() - t0, 2)

    return _analyse(
        plans,
        done,
        engine_seen=seen["requests"],
        gateway_log=_gateway_log(sv.gateway.log),
        counts=counts,
        counts_before=counts_before,
        extra={
            "load_s": round(load_s, 1),
            "req_per_s": round(len(done) / load_s, 1) if load_s else None,
            "gateway_cpu_ms_per_req": round(cpu * 1000 / len(done), 3) if done else None,
            "settled_after_s": settled_s,
            "settle_limit_s": args.settle_s,
            "peaks": peaks | {"rss_mib": rss_peak, "vmhwm_mib": _mib(peak_rss_kib(pid))},
            "gateway": {"before": before, "after_idle": after},
            "alive_at_the_end": alive,
            "status": {
                "after_load": _cut_summary(status_end),
                "after_idle": _cut_summary(status_idle),
                "after_restart_marker": _cut_summary(status_restart),
                "restart_waited_s": restart_waited,
            },
        },
    )


def _analyse(
    plans: list[Plan],
    results: list[Result],
    *,
    engine_seen: dict[str, list[Any]],
    gateway_log: dict[int, GatewaySaw],
    counts: dict[str, Any],
    counts_before: dict[str, Any],
    extra: dict[str, Any],
) -> dict[str, Any]:
    by_id = {p.rid: p for p in plans}
    failures: list[str] = []
    left_open: list[int] = []
    not_closed: list[int] = []
    body_reached: list[int] = []
    queued_reached = 0
    normal_not_served: list[Result] = []
    overload: list[Result] = []
    cut_mismatch: list[Result] = []
    for r in results:
        plan = by_id[r.rid]
        at = engine_seen.get(str(r.rid))
        r.at_engine = None if at is None else (at[1] or "open")
        saw = gateway_log.get(r.rid)
        r.gateway_cut = saw.cut if saw is not None else None
        want = _expected_cut(plan, r)
        if r.gateway_cut != want and want != "any":
            cut_mismatch.append(r)
        if r.at_engine == "open":
            left_open.append(r.rid)
        # Hung up by the client or faulted at the engine, and not finished there: closed.
        faulted = r.category == "hung_up" or plan.fault
        if at is not None and faulted and r.at_engine not in ("closed", "died", "finished"):
            not_closed.append(r.rid)
        if plan.phase == "body" and at is not None:
            body_reached.append(r.rid)
        if plan.phase == "queued" and r.category == "hung_up" and at is not None:
            queued_reached += 1
        if plan.phase == "none" and plan.mode == "normal" and r.category != "served":
            (overload if _queue_deadline(r) else normal_not_served).append(r)

    lost = [r for r in results if r.category == "lost"]
    # The engine's counts: this run's, the startup checks taken off.
    received = counts["received"] - counts_before["received"]
    ends = {
        k: counts[k] - counts_before[k] for k in ("finished", "hangups_seen", "died", "in_progress")
    }
    reached = len(engine_seen)
    add_up = (
        counts["received"]
        == counts["finished"] + counts["hangups_seen"] + counts["died"] + counts["in_progress"]
        and reached + counts["duplicates"] == received
    )
    if lost:
        failures.append(f"{len(lost)} request(s) lost")
    if counts["open_chat_connections"]:
        failures.append(
            f"{counts['open_chat_connections']} engine connection(s) that carried a chat request "
            f"still open {extra['settled_after_s']} s after the load"
        )
    if counts["in_progress"] or left_open:
        failures.append(
            f"{counts['in_progress']} request(s) still in progress at the engine "
            f"(ids {left_open[:10]})"
        )
    if not_closed:
        failures.append(f"hung-up or faulted requests not closed at the engine: {not_closed[:10]}")
    if counts["duplicates"]:
        failures.append(f"{counts['duplicates']} request(s) reached the engine twice")
    if not add_up:
        failures.append("the engine's counts do not add up")
    if normal_not_served:
        failures.append(f"{len(normal_not_served)} normal request(s) not hung up were not served")
    dead = [name for name, up in extra["alive_at_the_end"].items() if not up]
    if dead:
        failures.append(f"exited during the run: {', '.join(dead)}")
    gateway_sent_twice = [rid for rid, saw in gateway_log.items() if saw.selections > 1]
    if gateway_sent_twice:
        failures.append(f"requests the gateway sent to an engine twice: {gateway_sent_twice[:10]}")
    if body_reached:
        failures.append(
            f"requests hung up while sending their body reached the engine: {body_reached[:10]}"
        )

    kinds: dict[str, dict[str, Any]] = {}
    for r in results:
        row = kinds.setdefault(
            r.kind,
            {"n": 0, **dict.fromkeys(CATEGORIES, 0), "labels": Counter(), "engine": Counter()},
        )
        row["n"] += 1
        row[r.category] += 1
        row["labels"][r.label] += 1
        row["engine"][r.at_engine or "never"] += 1
    for row in kinds.values():
        row["labels"] = dict(row["labels"].most_common())
        row["engine"] = dict(row["engine"].most_common())
    normal = sorted(r.seconds for r in results if r.kind.startswith("none/normal/"))
    doc: dict[str, Any] = {
        "requests": len(results),
        "by_category": {c: sum(1 for r in results if r.category == c) for c in CATEGORIES},
        "by_outcome": dict(Counter(r.label for r in results).most_common()),
        "by_phase": dict(Counter(by_id[r.rid].phase for r in results)),
        "by_mode": dict(Counter(by_id[r.rid].mode for r in results)),
        "by_kind": dict(sorted(kinds.items())),
        "kinds_seen": len(kinds),
        "kinds_possible": len(COMBOS),
        "lost": len(lost),
        "lost_examples": [asdict(r) | {"plan": asdict(by_id[r.rid])} for r in lost[:20]],
        "normal_not_served": [asdict(r) for r in normal_not_served[:20]],
        "normal_refused_for_load": len(overload),
        "normal_seconds": {
            "p50": normal[len(normal) // 2] if normal else None,
            "p99": normal[min(len(normal) - 1, int(0.99 * len(normal)))] if normal else None,
            "max": normal[-1] if normal else None,
        },
        "engine": {
            "received": received,
            "reached_by_id": reached,
            **ends,
            "open_chat_connections": counts["open_chat_connections"],
            "open_connections": counts["open_connections"],
            "chat_connections_total": counts["chat_connections_total"]
            - counts_before["chat_connections_total"],
            "duplicates": counts["duplicates"],
            "by_mode": {
                m: counts["by_mode"][m] - counts_before["by_mode"].get(m, 0) for m in MODES
            },
            "counts_add_up": add_up,
            "left_open_ids": left_open[:20],
            "not_closed_ids": not_closed[:20],
        },
        "queued_hangups_that_reached_the_engine": queued_reached,
        "gateway_cut_reasons": {
            c: dict(Counter(str(r.gateway_cut) for r in results if r.category == c))
            for c in CATEGORIES
        },
        "gateway_cut_mismatches": len(cut_mismatch),
        "cut_but_never_received": sum(
            1 for r in results if r.gateway_cut is not None and r.at_engine is None
        ),
        "gateway_cut_mismatch_examples": [
            {
                "rid": r.rid,
                "kind": r.kind,
                "label": r.label,
                "detail": r.detail,
                "at_engine": r.at_engine,
                "gateway_cut": r.gateway_cut,
                "expected": _expected_cut(by_id[r.rid], r),
                "seconds": r.seconds,
            }
            for r in cut_mismatch[:20]
        ],  # fmt: skip
        "failures": failures,
        **extra,
    }
    return doc


# -- report -----------------------------------------------------------------------------------
def _yes(ok: bool) -> str:
    return "ok" if ok else "**FAILED**"


def markdown(doc: dict[str, Any]) -> str:
    m, r = doc["meta"], doc["run"]
    e, st, g = r["engine"], r["status"], r["gateway"]
    cat = r["by_category"]
    queued = sum(v["n"] for k, v in r["by_kind"].items() if k.startswith("queued/"))
    lines = [
        "## Fault soak (capyctl-gateway)",
        "",
        f"Seed {m['seed']}: {r['requests']:,} requests at concurrency {m['concurrency']} in "
        f"{r['load_s']} s ({r['req_per_s']} req/s; the whole run {m['elapsed_s']} s). Gateway: "
        f"request_deadline {m['deadline_s']:g} s, stream_idle_timeout {m['idle_s']:g} s, "
        f"max_running {m['max_running']}; its queue held up to {r['peaks']['gateway_waiting']} "
        f"waiting and {r['peaks']['gateway_running']} running.",
        "",
        "| check | measured | verdict |",
        "|---|---|---|",
        f"| lost requests | {r['lost']} | {_yes(r['lost'] == 0)} |",
        f"| engine connections that carried a chat request, open after the pool expired | "
        f"{e['open_chat_connections']} ({r['settled_after_s']} s after the load) | "
        f"{_yes(e['open_chat_connections'] == 0)} |",
        f"| requests still in progress at the engine | {e['in_progress']} | "
        f"{_yes(e['in_progress'] == 0 and not e['left_open_ids'])} |",
        f"| hung-up or faulted requests that reached the engine and were not closed there | "
        f"{len(e['not_closed_ids'])} | {_yes(not e['not_closed_ids'])} |",
        f"| engine: received = finished + hang-ups seen + died | {e['received']:,} = "
        f"{e['finished']:,} + {e['hangups_seen']:,} + {e['died']:,}; each id once "
        f"({e['duplicates']} twice) | {_yes(e['counts_add_up'] and not e['duplicates'])} |",
        f"| normal requests (no hang-up, no fault) served | "
        f"{sum(v['served'] for k, v in r['by_kind'].items() if k.startswith('none/normal/'))}/"
        f"{sum(v['n'] for k, v in r['by_kind'].items() if k.startswith('none/normal/'))} "
        f"(answer time p50 {r['normal_seconds']['p50']} s, max {r['normal_seconds']['max']} s) | "
        f"{_yes(not r['normal_not_served'])}"
        + (
            f" ({r['normal_refused_for_load']} refused with 503 for want of a running slot "
            "within the deadline: the machine was too loaded to show this)"
            if r["normal_refused_for_load"]
            else ""
        )
        + " |",
        f"| gateway in flight after the load (router_running; queue running/waiting) | "
        f"{st['after_idle'].get('router_running')}; {st['after_idle'].get('deployment_running')}"
        f"/{st['after_idle'].get('deployment_waiting')} | "
        f"{_yes(st['after_idle'].get('router_running') == 0)} |",
        f"| cut requests still counted: right after the load / after the idle wait / after the "
        f"engine's restart marker | {st['after_load'].get('cut_still_counted')} / "
        f"{st['after_idle'].get('cut_still_counted')} "
        f"({_rules(st['after_idle'])}) / {st['after_restart_marker'].get('cut_still_counted')} "
        f"(within {st['restart_waited_s']} s) | as documented |",
        f"| gateway RSS (MiB): idle before → peak → idle after | {g['before']['rss_mib']} → "
        f"{r['peaks']['rss_mib']} (VmHWM {r['peaks']['vmhwm_mib']}) → {g['after_idle']['rss_mib']}"
        " | |",
        f"| gateway open fds: idle before → peak → idle after | {g['before']['fds']} → "
        f"{r['peaks']['fds']} → {g['after_idle']['fds']} | "
        f"{_yes((g['after_idle']['fds'] or 0) <= (g['before']['fds'] or 0))} |",
        "",
        f"Outcomes: {cat['served']:,} served, {cat['http_error']:,} HTTP errors, "
        f"{cat['inband_error']:,} in-band errors, {cat['hung_up']:,} hung up, {cat['lost']} lost. "
        f"Of {queued} hang-ups planned while queued, {r['queued_hangups_that_reached_the_engine']}"
        " had reached the engine by then (the gateway closed those too). Gateway CPU "
        f"{r['gateway_cpu_ms_per_req']} ms per request.",
        "",
        "| plan (hang-up / engine / kind) | n | served | HTTP error | in-band error | hung up | "
        "lost | outcomes | at the engine |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, row in r["by_kind"].items():
        labels = ", ".join(f"{k} {v}" for k, v in row["labels"].items())
        lines.append(
            f"| {kind} | {row['n']} | {row['served']} | {row['http_error']} | "
            f"{row['inband_error']} | {row['hung_up']} | {row['lost']} | {labels} | "
            + ", ".join(f"{k} {v}" for k, v in row["engine"].items())
            + " |"
        )
    lines += [
        "",
        "Engine: " + ", ".join(f"{k} {v}" for k, v in e["by_mode"].items()) + " received; "
        f"{e['chat_connections_total']:,} connections carried chat requests.",
        "",
    ]
    mism = r["gateway_cut_mismatches"]
    lines += [
        f"The gateway's log, read back: {mism} request(s) whose cut reason (or its absence) is "
        "not the one the plan calls for (a client hang-up: hang_up; die: engine stream broken; "
        "hang: deadline; pings: idle_timeout; otherwise none)"
        + (": see the examples below." if mism else ".")
        + f" {r['cut_but_never_received']} hung-up request(s) were cut on their way to the engine "
        "and never reached it; the gateway, which cannot tell, charges them like the others.",
        "",
    ]
    for ex in r["gateway_cut_mismatch_examples"]:
        lines.append(
            f"- id {ex['rid']} ({ex['kind']}, {ex['label']}, {ex['seconds']} s): the gateway "
            f"logged cut {ex['gateway_cut']!r}, expected {ex['expected']!r}; at the engine "
            f"{ex['at_engine']}"
        )
    for ex in r["lost_examples"]:
        lines.append(f"- LOST id {ex['rid']} ({ex['kind']}): {ex['detail']}; plan {ex['plan']}")
    for ex in r["normal_not_served"]:
        lines.append(f"- normal, not served: id {ex['rid']}: {ex['label']} ({ex['detail']})")
    if r["failures"]:
        lines += ["", "**Failures:** " + "; ".join(r["failures"]) + "."]
    lines.append("")
    return "\n".join(lines)


def _rules(s: dict[str, Any]) -> str:
    rules = s.get("by_settle_rule") or {}
    return ", ".join(f"{v} {k}" for k, v in rules.items()) or "none"


# -- main -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.faults", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="200 requests")
    parser.add_argument("--requests", type=int, default=None, help="default 2,000 (quick: 200)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=None, help="default: a random one (reported)")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated plan kinds or prefixes (e.g. mid_stream/normal), to reproduce",
    )
    parser.add_argument("--max-running", type=int, default=16, help="the gateway's running slots")
    parser.add_argument("--deadline-s", type=float, default=3.0, help="queue.request_deadline")
    parser.add_argument("--idle-s", type=float, default=1.0, help="queue.stream_idle_timeout")
    parser.add_argument("--client-timeout-s", type=float, default=30.0, help="per request")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=20.0,
        help="at most this long after the load for the engine's connections to close",
    )
    parser.add_argument("--restart-wait-s", type=float, default=5.0)
    parser.add_argument("--json", type=Path, default=None, help="write every measurement here")
    parser.add_argument("--keep", action="store_true", help="keep the logs' directory")
    args = parser.parse_args(argv)
    if args.requests is None:
        args.requests = 200 if args.quick else 2000
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 2**31)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    limits = _raise_nofile(max(4096, 8 * args.concurrency + 1024), log)
    only = [o.strip() for o in args.only.split(",") if o.strip()] if args.only else None
    try:
        plans = make_plans(args.requests, args.seed, only)
    except ValueError as exc:
        parser.error(str(exc))
    log(f"faults: seed {args.seed}, {len(plans):,} requests at concurrency {args.concurrency}")
    work = Path(tempfile.mkdtemp(prefix="capyctl-faults-"))
    procs = ProcessSet(work)
    old = {s: signal.signal(s, _terminate) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    started = time.monotonic()
    keep = args.keep
    try:
        sv = _serve(args, procs, work)
        processes = {p.name: p.pid for p in procs.procs}
        run = _run_async(_soak(args, sv, plans, log))
    except StartupError as exc:
        log(f"faults: {exc}")
        return 2
    finally:
        procs.stop_all()
        for s, h in old.items():
            signal.signal(s, h)
    if run["failures"]:
        keep = True
    if keep:
        log(f"faults: logs in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    doc: dict[str, Any] = {
        "meta": {
            "seed": args.seed,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "quick": args.quick,
            "only": only,
            "max_running": args.max_running,
            "deadline_s": args.deadline_s,
            "idle_s": args.idle_s,
            "client_timeout_s": args.client_timeout_s,
            "machine": _machine(),
            "rlimit_nofile": limits,
            "processes": processes,
            "elapsed_s": round(time.monotonic() - started, 1),
            "load_avg_at_end": os.getloadavg(),
            "logs": str(work) if keep else None,
        },
        "run": run,
    }
    print(markdown(doc), flush=True)
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return 1 if run["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
