"""A fault-injecting vLLM-shaped engine for the fault soak (``bench/perf/faults.py``); its own
process, raw asyncio + uvloop, one HTTP/1.1 keep-alive connection per protocol object.

``POST /v1/chat/completions`` always answers a vLLM 0.31-shaped event stream (the gateway always
asks for one): an opening role chunk, content chunks (chunk ``i`` carries the text ``" t<i>"``),
a finish chunk, a usage chunk when ``stream_options.include_usage`` is set, ``data: [DONE]``.
Each request picks its behaviour from its ``"user"`` field, a field the gateway relays as sent,
``key=value`` pairs joined by ``;``, e.g. ``"id=17;mode=slow;chunks=20;gap_ms=5;ttft_ms=800"``:

* ``normal``: the stream, ``chunks`` content chunks ``gap_ms`` apart;
* ``slow``: the role chunk at once, then ``ttft_ms`` before the first content chunk;
* ``hang``: accepts the request and never sends a byte;
* ``die``: the role chunk and ``die_after`` content chunks, then the TCP connection is aborted
  (a reset; ``die_after=0``: aborted before any byte);
* ``pings``: the role chunk and one content chunk, then only ``: ping`` comments ``ping_ms``
  apart, for ever.

The engine counts, exactly: chat requests received, streams finished (the end of the chunked
body written), streams whose connection the other side closed before their end (hang-ups seen),
streams it aborted itself (``die``), streams in progress, and the connections open now that
carried a chat request. ``id`` names a request: the engine keeps each one's mode and how it ended,
and counts an id received twice. Debug routes (never used by the gateway):

* ``GET /debug/counts``: the counts, as JSON;
* ``GET /debug/requests``: ``{"requests": {"<id>": [mode, end]}}``, end ``finished``,
  ``closed`` (a hang-up seen), ``died`` or null (still in progress);
* ``GET /debug/arrived?id=N&timeout_s=T``: answers ``{"arrived": true}`` once request N has
  arrived (at once if it already has), ``false`` after T seconds (at most 60);
* ``POST /debug/restart``: moves ``process_start_time_seconds`` on, as a restarted vLLM would.

The collector's routes (``/health``, ``/version``, ``/v1/models``, ``/metrics``) answer as vLLM
does; ``vllm:num_requests_running`` is the streams in progress.

Run: ``.venv/bin/python -m bench.perf.fault_engine --port 8100``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, cast
from urllib.parse import parse_qs

import orjson

from .fake_engine import (
    LAST_CHUNK,
    MAX_BODY,
    MAX_HEAD,
    SSE_HEAD,
    _dechunk,
    _event,
    _frame,
    _response,
)

__all__ = ["MODES", "Behaviour", "Counts", "FaultEngine", "content_text", "main", "parse_user"]

MODES = ("normal", "slow", "hang", "die", "pings")
CREATED = 1796000000
PROMPT_TOKENS = 8
MAX_CHUNKS = 10_000
PING = _frame(b": ping\n\n")


def content_text(i: int) -> str:
    """The text of content chunk ``i``: the client checks the joined text against this."""
    return f" t{i}"


@dataclass(slots=True)
class Behaviour:
    """What one chat request asked of the engine (from its ``user`` field)."""

    rid: int | None = None
    mode: str = "normal"
    chunks: int = 8
    gap_ms: float = 0.0
    ttft_ms: float = 0.0
    die_after: int = 1
    ping_ms: float = 200.0


def parse_user(text: Any) -> Behaviour:
    """``"id=17;mode=slow;ttft_ms=800"`` to a `Behaviour`; what it cannot read is left default."""
    b = Behaviour()
    if not isinstance(text, str):
        return b
    for part in text.split(";"):
        key, _, value = part.partition("=")
        key, value = key.strip(), value.strip()
        try:
            if key == "id":
                b.rid = int(value)
            elif key == "mode" and value in MODES:
                b.mode = value
            elif key == "chunks":
                b.chunks = max(1, min(MAX_CHUNKS, int(value)))
            elif key == "gap_ms":
                b.gap_ms = max(0.0, float(value))
            elif key == "ttft_ms":
                b.ttft_ms = max(0.0, float(value))
            elif key == "die_after":
                b.die_after = max(0, int(value))
            elif key == "ping_ms":
                b.ping_ms = max(10.0, float(value))
        except ValueError:
            continue
    return b


@dataclass(slots=True)
class Counts:
    received: int = 0
    """Chat requests received (parsed whole)."""
    finished: int = 0
    """Streams whose last byte (the end of the chunked body) the engine wrote."""
    hangups_seen: int = 0
    """Streams whose connection the other side closed before the engine had finished."""
    died: int = 0
    """Streams the engine aborted itself (mode ``die``)."""
    in_progress: int = 0
    """Streams received and not yet finished, closed or died."""
    open_chat_connections: int = 0
    """Connections open now that carried at least one chat request."""
    open_connections: int = 0
    """Every connection open now (the collector's included)."""
    chat_connections_total: int = 0
    connections_total: int = 0
    duplicates: int = 0
    """Requests whose id had been received before (a request sent twice)."""
    without_id: int = 0
    bad_requests: int = 0
    by_mode: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODES, 0))


@dataclass(slots=True)
class Seen:
    """One chat request as the engine saw it."""

    mode: str
    end: str | None = None
    """finished, closed (a hang-up seen) or died; None while in progress."""


class FaultEngine:
    """What all connections share: the counts, the requests seen by id, the start marker."""

    def __init__(self, served: str) -> None:
        self.served = served
        self.counts = Counts()
        self.seen: dict[int, Seen] = {}
        self._arrivals: dict[int, asyncio.Event] = {}
        self.process_start = round(time.time(), 3)
        self.health = _response("200 OK", b"text/plain", b"")
        self.version = _response("200 OK", b"application/json", b'{"version":"0.31.0"}')
        self.models = _response(
            "200 OK",
            b"application/json",
            orjson.dumps(
                {"object": "list", "data": [{"id": served, "object": "model", "owned_by": "vllm"}]}
            ),
        )
        self.not_found = _response("404 Not Found", b"application/json", b'{"detail":"Not Found"}')
        self.bad_request = _response(
            "400 Bad Request", b"application/json", b'{"error":{"message":"bad request"}}'
        )

    # -- the collector's routes -------------------------------------------------------------
    def metrics(self) -> bytes:
        labels = f'engine="0",model_name="{self.served}"'
        text = (
            "# TYPE process_start_time_seconds gauge\n"
            f"process_start_time_seconds {self.process_start}\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {float(self.counts.in_progress)}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} 0.0\n"
            "# TYPE vllm:cache_config_info gauge\n"
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
        )
        return _response("200 OK", b"text/plain; version=0.0.4", text.encode())

    # -- the debug routes -------------------------------------------------------------------
    def counts_doc(self) -> bytes:
        return _json_answer(asdict(self.counts))

    def requests_doc(self) -> bytes:
        doc = {str(k): [v.mode, v.end] for k, v in self.seen.items()}
        return _json_answer({"requests": doc})

    def arrival(self, rid: int) -> asyncio.Event:
        ev = self._arrivals.get(rid)
        if ev is None:
            ev = self._arrivals[rid] = asyncio.Event()
        return ev

    def restart(self) -> bytes:
        self.process_start = round(self.process_start + 1.0, 3)
        return _json_answer({"process_start": self.process_start})

    # -- chat -------------------------------------------------------------------------------
    def chunk(self, cid: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
        doc = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": self.served,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        return _frame(_event(doc))

    def usage(self, cid: str, n: int) -> bytes:
        doc = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": self.served,
            "choices": [],
            "usage": {
                "prompt_tokens": PROMPT_TOKENS,
                "total_tokens": PROMPT_TOKENS + n,
                "completion_tokens": n,
            },
        }
        return _frame(_event(doc))


def _json_answer(doc: Any) -> bytes:
    return _response("200 OK", b"application/json", orjson.dumps(doc))


class Connection(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection; requests are answered one at a time, in order."""

    def __init__(self, engine: FaultEngine) -> None:
        self._engine = engine
        self._buf = b""
        self._busy = False
        self._task: asyncio.Task[None] | None = None
        self._transport: asyncio.Transport | None = None
        self._carried_chat = False
        self._current: Seen | None = None
        """The chat request being answered (None between requests, or once it ended)."""

    # -- the connection ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        c = self._engine.counts
        c.open_connections += 1
        c.connections_total += 1
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        c = self._engine.counts
        c.open_connections -= 1
        if self._carried_chat:
            c.open_chat_connections -= 1
        cur = self._current
        if cur is not None:  # closed by the other side before the stream's end
            self._current = None
            cur.end = "closed"
            c.hangups_seen += 1
            c.in_progress -= 1
        if self._task is not None:
            self._task.cancel()

    def data_received(self, data: bytes) -> None:
        self._buf = self._buf + data if self._buf else data
        if not self._busy:
            self._process()

    def _process(self) -> None:
        while self._transport is not None and not self._busy:
            buf = self._buf
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    self._transport.close()
                return
            lines = buf[:end].split(b"\r\n")
            parts = lines[0].split(b" ")
            if len(parts) != 3:
                self._transport.close()
                return
            method, target, version = parts
            headers: dict[bytes, bytes] = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            start = end + 4
            length = headers.get(b"content-length")
            if length is not None:
                size = int(length)
                if size > MAX_BODY:
                    self._transport.close()
                    return
                if len(buf) < start + size:
                    return
                body, self._buf = buf[start : start + size], buf[start + size :]
            elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
                parsed = _dechunk(buf, start)
                if parsed is None:
                    return
                body, self._buf = parsed
            else:
                body, self._buf = b"", buf[start:]
            keep = version == b"HTTP/1.1" and headers.get(b"connection", b"").lower() != b"close"
            path, _, query = target.partition(b"?")
            self._handle(method, path, query.decode("latin-1"), body, keep)

    def _handle(self, method: bytes, path: bytes, query: str, body: bytes, keep: bool) -> None:
        transport = self._transport
        assert transport is not None
        engine = self._engine
        if method == b"POST" and path == b"/v1/chat/completions":
            self._chat(body, keep)
            return
        if method == b"GET" and path == b"/debug/arrived":
            self._arrived(parse_qs(query), keep)
            return
        if method == b"POST" and path == b"/debug/restart":
            answer = engine.restart()
        elif method != b"GET":
            answer = engine.not_found
        elif path == b"/health":
            answer = engine.health
        elif path == b"/metrics":
            answer = engine.metrics()
        elif path == b"/version":
            answer = engine.version
        elif path == b"/v1/models":
            answer = engine.models
        elif path == b"/debug/counts":
            answer = engine.counts_doc()
        elif path == b"/debug/requests":
            answer = engine.requests_doc()
        else:
            answer = engine.not_found
        transport.write(answer)
        if not keep:
            transport.close()

    def _later(self, work: Callable[[], Awaitable[None]], keep: bool) -> None:
        """Answer the current request from a task; the next one waits for it."""
        self._busy = True

        async def run() -> None:
            try:
                await work()
            except asyncio.CancelledError:
                return
            finally:
                self._task = None
            self._busy = False
            if self._transport is not None:
                if keep:
                    self._process()
                else:
                    self._transport.close()

        self._task = asyncio.get_running_loop().create_task(run())

    # -- /debug/arrived ---------------------------------------------------------------------
    def _arrived(self, query: dict[str, list[str]], keep: bool) -> None:
        try:
            rid = int(query["id"][0])
            timeout_s = min(60.0, float(query.get("timeout_s", ["10"])[0]))
        except (KeyError, ValueError):
            self._write(self._engine.bad_request)
            return
        ev = self._engine.arrival(rid)

        async def wait() -> None:
            arrived = True
            if not ev.is_set():
                try:
                    await asyncio.wait_for(ev.wait(), timeout_s)
                except TimeoutError:
                    arrived = False
            self._write(_json_answer({"arrived": arrived}))

        self._later(wait, keep)

    # -- chat -------------------------------------------------------------------------------
    def _chat(self, body: bytes, keep: bool) -> None:
        engine = self._engine
        c = engine.counts
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            doc = None
        if type(doc) is not dict:
            c.bad_requests += 1
            self._write(engine.bad_request)
            if self._transport is not None:
                self._transport.close()
            return
        b = parse_user(doc.get("user"))
        options = doc.get("stream_options")
        usage = type(options) is dict and options.get("include_usage") is True
        c.received += 1
        c.by_mode[b.mode] += 1
        if not self._carried_chat:
            self._carried_chat = True
            c.open_chat_connections += 1
            c.chat_connections_total += 1
        seen = Seen(b.mode)
        if b.rid is None:
            c.without_id += 1
        else:
            if b.rid in engine.seen:
                c.duplicates += 1
            engine.seen[b.rid] = seen
            engine.arrival(b.rid).set()
        c.in_progress += 1
        self._current = seen
        cid = f"chatcmpl-fault{b.rid if b.rid is not None else 0:012d}"

        async def stream() -> None:
            await self._stream(b, cid, usage)

        self._later(stream, keep)

    async def _stream(self, b: Behaviour, cid: str, usage: bool) -> None:
        engine = self._engine
        if b.mode == "hang":
            await asyncio.Event().wait()  # until the connection is closed
        if b.mode == "die" and b.die_after == 0:
            self._die()
            return
        self._write(SSE_HEAD + engine.chunk(cid, {"role": "assistant", "content": ""}))
        if b.mode == "slow" and b.ttft_ms > 0:
            await asyncio.sleep(b.ttft_ms / 1000)
        chunks = 1 if b.mode == "pings" else b.chunks
        for i in range(chunks):
            if i and b.gap_ms > 0:
                await asyncio.sleep(b.gap_ms / 1000)
            self._write(engine.chunk(cid, {"content": content_text(i)}))
            if b.mode == "die" and i + 1 >= b.die_after:
                self._die()
                return
        if b.mode == "pings":
            while True:
                await asyncio.sleep(b.ping_ms / 1000)
                self._write(PING)
        tail = engine.chunk(cid, {}, "length")
        if usage:
            tail += engine.usage(cid, chunks)
        self._write(tail + _frame(b"data: [DONE]\n\n") + LAST_CHUNK)
        self._end("finished")

    def _end(self, how: str) -> None:
        cur = self._current
        if cur is None:
            return
        self._current = None
        cur.end = how
        c = self._engine.counts
        c.in_progress -= 1
        if how == "finished":
            c.finished += 1
        else:
            c.died += 1

    def _die(self) -> None:
        self._end("died")
        if self._transport is not None:
            self._transport.abort()
        raise asyncio.CancelledError

    def _write(self, data: bytes) -> None:
        if self._transport is None:
            raise asyncio.CancelledError
        self._transport.write(data)


async def serve(host: str, port: int, served: str) -> None:
    """Serve until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    engine = FaultEngine(served)
    server = await loop.create_server(
        lambda: Connection(engine), host, port, reuse_address=True, backlog=1024
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bound = server.sockets[0].getsockname()[1]
    print(f"fault engine listening on http://{host}:{bound}", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.fault_engine", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="0: any free port (printed)")
    parser.add_argument("--served", default="tiny", help="the model id the engine serves")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(serve(args.host, args.port, args.served))
    else:
        uvloop.run(serve(args.host, args.port, args.served))


if __name__ == "__main__":
    main()
