"""A lean SSE load client: C keep-alive connections, each sending one streamed chat request after
another, timing the first content chunk and the whole stream (raw asyncio protocol on uvloop).
With ``--api responses`` the same request goes to ``POST /v1/responses`` instead, with ``--api
messages`` to ``POST /v1/messages`` (the gateway's only; an engine serves neither).

A stream counts as completed when the response is 200 and its body ends with ``data: [DONE]``
(a Responses stream: holds its ``response.completed`` or ``response.incomplete`` event; a
Messages stream: its ``message_stop``).
Only streams that end inside the measured window count; a warm-up comes first. With ``--cpu-pid``
the client reads those processes' CPU time from ``/proc`` at the exact start and end of the
window, so the runner can charge CPU per request.

Run: ``.venv/bin/python -m bench.perf.sse_client --url http://127.0.0.1:8100 -c 32 -d 5``
(prints one JSON document).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import orjson

from ._procfs import cpu_seconds

__all__ = ["API", "LoadResult", "build_request", "main", "run_load"]

DONE_TAIL = b"data: [DONE]\n\n"
LAST = b"\r\n0\r\n\r\n"


@dataclass(frozen=True)
class Api:
    """Where a request goes and how its answer is read."""

    path: str
    content: bytes
    """What begins a piece of text (followed by anything but a closing quote: not empty)."""
    empty: bytes
    """The same with no text (counted out)."""
    whole: Callable[[bytes], bool]
    """Whether a streamed body ended as a whole answer does."""

    def pieces(self, body: bytes) -> int:
        """The pieces of text a streamed body holds."""
        return body.count(self.content) - body.count(self.empty)


def _whole_response(body: bytes) -> bool:
    # completed, or incomplete at max_output_tokens (as chat ends on "length"); a failed
    # Response ends in response.failed
    return b"event: response.completed\n" in body or b"event: response.incomplete\n" in body


CHAT = Api("/v1/chat/completions", b'"content":"', b'"content":""', lambda b: b.endswith(DONE_TAIL))
RESPONSES = Api(
    "/v1/responses", b'"type":"response.output_text.delta"', b'"delta":""', _whole_response
)
MESSAGES = Api(
    "/v1/messages",
    b'"delta":{"type":"text_delta","text":"',
    b'"delta":{"type":"text_delta","text":""',
    lambda b: b"event: message_stop\n" in b,
)
API = {"chat": CHAT, "responses": RESPONSES, "messages": MESSAGES}


def build_request(
    url: str,
    *,
    model: str,
    chunks: int,
    key: str | None = None,
    stream: bool = True,
    ttft_ms: float | None = None,
    delay_ms: float | None = None,
    api: Api = CHAT,
) -> bytes:
    """The bytes of one request (sent unchanged on every round trip): chat, or the same
    question to the Responses API."""
    parts = urlsplit(url)
    body: dict[str, Any] = {"model": model}
    if api is RESPONSES:
        body |= {"input": "Say something.", "max_output_tokens": chunks}
        if stream:
            body["stream"] = True
    elif api is MESSAGES:
        body |= {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": chunks}
        if stream:
            body["stream"] = True
    else:
        body |= {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": chunks}
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
    meta = {}
    if ttft_ms is not None:
        meta["bench_ttft_ms"] = str(ttft_ms)
    if delay_ms is not None:
        meta["bench_delay_ms"] = str(delay_ms)
    if meta:
        body["metadata"] = meta
    raw = orjson.dumps(body)
    head = [
        f"POST {api.path} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Content-Type: application/json",
        "Accept: text/event-stream" if stream else "Accept: application/json",
        f"Content-Length: {len(raw)}",
    ]
    if key:
        head.append(f"Authorization: Bearer {key}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + raw


class ProtocolError(Exception):
    pass


def dechunk(raw: bytes) -> bytes | None:
    """The payload of a complete chunked body (no trailers); None if it is not complete."""
    parts: list[bytes] = []
    pos, n = 0, len(raw)
    while True:
        eol = raw.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(raw[pos:eol].split(b";", 1)[0], 16)
        pos = eol + 2
        if size == 0:
            return b"".join(parts) if raw[pos:] == b"\r\n" else None
        if pos + size + 2 > n:
            return None
        parts.append(raw[pos : pos + size])
        pos += size + 2


class _Exchange(asyncio.Protocol):
    """One keep-alive connection; one request at a time; a tiny HTTP/1.1 response parser."""

    def __init__(self, content: bytes = CHAT.content) -> None:
        self._content = content
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._fut: asyncio.Future[tuple[bool, float | None, float, bytes]] | None = None
        self._reset()

    def _reset(self) -> None:
        self._head = True
        self._buf = b""
        self._status = 0
        self._keep = True
        self._chunked = False
        self._left = -1  # content-length bytes still to come; -1: until close
        self._pieces: list[bytes] = []
        self._scan = 0  # bytes of the body already searched for the first content chunk
        self._first: float | None = None

    # -- asyncio.Protocol ------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        fut = self._fut
        if fut is not None and not fut.done():
            if not self._head and not self._chunked and self._left < 0:
                self._finish(time.perf_counter(), b"".join(self._pieces))  # ended by the close
            else:
                fut.set_exception(ProtocolError("connection closed mid-response"))

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self._fut is None:
            return
        try:
            self._feed(data, now)
        except (ValueError, ProtocolError) as exc:
            if not self._fut.done():
                self._fut.set_exception(ProtocolError(str(exc)))
            if self.transport is not None:
                self.transport.close()

    # -- one exchange ----------------------------------------------------------------
    def send(self, request: bytes) -> asyncio.Future[tuple[bool, float | None, float, bytes]]:
        assert self.transport is not None
        self._reset()
        fut = self._fut = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return fut

    def _feed(self, data: bytes, now: float) -> None:
        if self._head:
            buf = self._buf + data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self._buf = buf
                return
            lines = buf[:end].split(b"\r\n")
            self._status = int(lines[0].split(b" ", 2)[1])
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                value = value.strip().lower()
                if name == b"transfer-encoding" and value == b"chunked":
                    self._chunked = True
                elif name == b"content-length":
                    self._left = int(value)
                elif name == b"connection" and value == b"close":
                    self._keep = False
            self._head = False
            self._buf = b""
            data = buf[end + 4 :]
        if data:
            self._pieces.append(data)
        if self._first is None and self._pieces:
            self._look_for_content(now)
        if self._chunked:
            # Cheap test first: the raw bytes end like a chunked body's last chunk. A full
            # parse then confirms it (an SSE payload ends in a newline, never in "0\r\n\r\n").
            tail = data if len(data) >= len(LAST) else b"".join(self._pieces)[-len(LAST) :]
            if tail.endswith(LAST):
                body = dechunk(b"".join(self._pieces))
                if body is not None:
                    self._finish(now, body)
        elif self._left >= 0:
            self._left -= len(data)
            if self._left <= 0:
                self._finish(now, b"".join(self._pieces))

    def _look_for_content(self, now: float) -> None:
        # The first chunk with text: '"content":"' followed by anything but the closing quote
        # (a Responses stream: its first text delta event).
        body = b"".join(self._pieces) if len(self._pieces) > 1 else self._pieces[0]
        marker = self._content
        pos = max(0, self._scan - len(marker))
        while True:
            i = body.find(marker, pos)
            if i < 0 or i + len(marker) >= len(body):
                self._scan = len(body) if i < 0 else i
                return
            if body[i + len(marker)] != 0x22:  # '"': an empty content string
                self._first = now
                return
            pos = i + len(marker)

    def _finish(self, now: float, body: bytes) -> None:
        fut = self._fut
        self._fut = None
        if fut is None or fut.done():
            return
        fut.set_result((self._status == 200, self._first, now, body))
        if not self._keep and self.transport is not None:
            self.transport.close()


@dataclass
class LoadResult:
    completed: int = 0
    failed: int = 0
    window_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    total_s: list[float] = field(default_factory=list)
    events: int = 0
    content_chunks: int = 0
    cpu_s: dict[int, float] = field(default_factory=dict)
    client_cpu_s: float = 0.0
    first_error: str | None = None

    def summary(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float | None:
            if not xs:
                return None
            s = sorted(xs)
            return round(s[min(len(s) - 1, int(q * len(s)))] * 1000, 3)

        rate = self.completed / self.window_s if self.window_s else 0.0
        return {
            "completed": self.completed,
            "failed": self.failed,
            "window_s": round(self.window_s, 4),
            "req_per_s": round(rate, 1),
            "ttft_ms": {"p50": pct(self.ttft_s, 0.5), "p99": pct(self.ttft_s, 0.99)},
            "total_ms": {"p50": pct(self.total_s, 0.5), "p99": pct(self.total_s, 0.99)},
            "events": self.events,
            "content_chunks": self.content_chunks,
            "cpu_s": {str(k): round(v, 4) for k, v in self.cpu_s.items()},
            "client_cpu_s": round(self.client_cpu_s, 4),
            "first_error": self.first_error,
        }


def _client_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def run_load(
    url: str,
    request: bytes,
    *,
    concurrency: int,
    duration_s: float | None = None,
    count: int | None = None,
    warmup_s: float = 0.0,
    cpu_pids: list[int] | None = None,
    stream: bool = True,
    timeout_s: float = 30.0,
    api: Api = CHAT,
) -> LoadResult:
    """Run the load; count only what ends inside the window (after the warm-up)."""
    if (duration_s is None) == (count is None):
        raise ValueError("give a duration or a count")
    loop = asyncio.get_running_loop()
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    result = LoadResult()
    pids = cpu_pids or []
    state = {"measuring": warmup_s <= 0, "stop": False, "started": 0}
    marks: dict[str, float] = {}
    cpu0: dict[int, float] = {}
    window_done = asyncio.Event()

    def open_window() -> None:
        marks["t0"] = time.perf_counter()
        marks["c0"] = _client_cpu()
        for pid in pids:
            cpu0[pid] = cpu_seconds([pid])
        state["measuring"] = True

    def close_window() -> None:
        if "t1" in marks:
            return
        marks["t1"] = time.perf_counter()
        for pid in pids:
            result.cpu_s[pid] = cpu_seconds([pid]) - cpu0.get(pid, 0.0)
        result.client_cpu_s = _client_cpu() - marks.get("c0", 0.0)
        state["measuring"] = False
        state["stop"] = True
        window_done.set()

    async def worker() -> None:
        conn: _Exchange | None = None
        try:
            while not state["stop"]:
                if count is not None:
                    if state["started"] >= count:
                        return
                    state["started"] += 1
                if conn is None or conn.closed:
                    _, proto = await loop.create_connection(
                        lambda: _Exchange(api.content), host, port
                    )
                    conn = proto
                t0 = time.perf_counter()
                try:
                    ok, first, end, body = await asyncio.wait_for(conn.send(request), timeout_s)
                except (ProtocolError, OSError, TimeoutError) as exc:
                    if state["measuring"]:
                        result.failed += 1
                        result.first_error = result.first_error or repr(exc)
                    if conn.transport is not None:
                        conn.transport.close()
                    conn = None
                    continue
                if not state["measuring"] or end < marks.get("t0", 0.0):
                    continue
                if not ok or (stream and not api.whole(body)):
                    result.failed += 1
                    result.first_error = result.first_error or body[:300].decode("replace")
                    continue
                result.completed += 1
                result.total_s.append(end - t0)
                if first is not None:
                    result.ttft_s.append(first - t0)
                result.events += body.count(b"data: ")
                result.content_chunks += api.pieces(body)
        finally:
            if conn is not None and conn.transport is not None:
                conn.transport.close()

    if warmup_s > 0:
        loop.call_later(warmup_s, open_window)
    else:
        open_window()
    if duration_s is not None:
        loop.call_later(warmup_s + duration_s, close_window)
    tasks = [loop.create_task(worker()) for _ in range(concurrency)]
    await asyncio.gather(*tasks)
    close_window()
    await window_done.wait()
    result.window_s = marks["t1"] - marks["t0"]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.sse_client", description=__doc__)
    parser.add_argument("--url", required=True, help="the target's origin, e.g. http://h:p")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--key", default=None, help="bearer key")
    parser.add_argument("-c", "--concurrency", type=int, default=32)
    parser.add_argument("-d", "--duration", type=float, default=None, help="window, seconds")
    parser.add_argument("-n", "--count", type=int, default=None, help="requests, instead")
    parser.add_argument("--warmup", type=float, default=0.0, help="seconds before the window")
    parser.add_argument("--chunks", type=int, default=16, help="content chunks (max_tokens)")
    parser.add_argument("--ttft-ms", type=float, default=None)
    parser.add_argument("--delay-ms", type=float, default=None)
    parser.add_argument("--no-stream", action="store_true", help="non-streamed requests")
    parser.add_argument("--cpu-pid", type=int, action="append", default=[])
    parser.add_argument("--api", choices=sorted(API), default="chat", help="the API asked")
    args = parser.parse_args(argv)
    if args.duration is None and args.count is None:
        args.duration = 5.0
    request = build_request(
        args.url,
        model=args.model,
        chunks=args.chunks,
        key=args.key,
        stream=not args.no_stream,
        ttft_ms=args.ttft_ms,
        delay_ms=args.delay_ms,
        api=API[args.api],
    )
    coro = run_load(
        args.url,
        request,
        concurrency=args.concurrency,
        duration_s=args.duration,
        count=args.count,
        warmup_s=args.warmup,
        cpu_pids=args.cpu_pid,
        stream=not args.no_stream,
        api=API[args.api],
    )
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        result = asyncio.run(coro)
    else:
        result = uvloop.run(coro)
    sys.stdout.buffer.write(orjson.dumps(result.summary()) + b"\n")


if __name__ == "__main__":
    main()
