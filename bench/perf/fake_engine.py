"""A fast vLLM-shaped fake engine for benchmarking only (its own process, raw asyncio + uvloop).

``POST /v1/chat/completions`` with ``"stream": true`` answers a vLLM 0.31-shaped SSE stream that
passes the gateway's verifier: an opening role chunk, N content chunks, a finish chunk, a usage
chunk (``choices: []``) when ``stream_options.include_usage`` is set, then ``data: [DONE]``.
Without ``stream`` it answers one ``chat.completion`` document (the direct baseline for
non-streamed requests). The collector's endpoints (``/health``, ``/version``, ``/v1/models``,
``/metrics``) answer as vLLM does.

N comes from the ``X-Bench-Chunks`` header, else the body's ``max_tokens`` (the one knob every
relay passes through unchanged), else ``--chunks``. Time to first token and the delay between
chunks come from ``X-Bench-TTFT-Ms`` / ``X-Bench-Delay-Ms``, else the body's
``metadata.bench_ttft_ms`` / ``metadata.bench_delay_ms``, else ``--ttft-ms`` / ``--delay-ms``.

Every response's bytes are built once and cached, so the engine costs little CPU. Each SSE event
is its own HTTP chunk and its own ``write`` (one ``send``, TCP_NODELAY on), as an engine that
emits tokens one by one produces them; ``--coalesce`` writes a whole stream at once instead.

Run: ``.venv/bin/python -m bench.perf.fake_engine --port 8100``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
from dataclasses import dataclass
from typing import Any, cast

import orjson

__all__ = ["EngineOptions", "main", "serve"]

CHUNK_ID = "chatcmpl-bench0000000000000000"
CREATED = 1796000000
TEXT = " tok"
PROMPT_TOKENS = 8
MAX_CHUNKS = 100_000
MAX_HEAD = 64 * 1024
MAX_BODY = 128 * 1024 * 1024
"""The largest body it reads (past the gateway's own 64 MiB limit: what the gateway forwards
is read whole, as a real engine would)."""
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"content-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
LAST_CHUNK = b"0\r\n\r\n"


@dataclass(frozen=True, slots=True)
class EngineOptions:
    served: str = "tiny"
    chunks: int = 16
    ttft_ms: float = 0.0
    delay_ms: float = 0.0
    coalesce: bool = False


def _frame(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%b\r\n" % (len(payload), payload)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _response(status: str, ctype: bytes, body: bytes) -> bytes:
    return (
        f"HTTP/1.1 {status}\r\n".encode()
        + b"content-type: "
        + ctype
        + b"\r\ncontent-length: %d\r\n\r\n" % len(body)
        + body
    )


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (str, bytes)):
        try:
            return float(value)
        except ValueError:
            return None
    return None


class Catalogue:
    """The pre-built bytes of every answer, per chunk count."""

    def __init__(self, opts: EngineOptions) -> None:
        served = opts.served

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {
                "id": CHUNK_ID,
                "object": "chat.completion.chunk",
                "created": CREATED,
                "model": served,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }

        self.served = served
        self.role = _frame(_event(chunk({"role": "assistant", "content": ""})))
        self.content = _frame(_event(chunk({"content": TEXT})))
        self.finish = _frame(_event(chunk({}, "length")))
        self.done = _frame(b"data: [DONE]\n\n") + LAST_CHUNK
        self._usage: dict[int, bytes] = {}
        self._whole: dict[tuple[int, bool], bytes] = {}
        self._json: dict[int, bytes] = {}
        self.health = _response("200 OK", b"text/plain", b"")
        self.version = _response("200 OK", b"application/json", orjson.dumps({"version": "0.31.0"}))
        self.models = _response(
            "200 OK",
            b"application/json",
            orjson.dumps(
                {
                    "object": "list",
                    "data": [{"id": served, "object": "model", "owned_by": "vllm"}],
                }
            ),
        )
        self.not_found = _response("404 Not Found", b"application/json", b'{"detail":"Not Found"}')
        self.bad_request = _response(
            "400 Bad Request", b"application/json", b'{"error":{"message":"bad request"}}'
        )

    def usage(self, n: int) -> bytes:
        frame = self._usage.get(n)
        if frame is None:
            doc = {
                "id": CHUNK_ID,
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
            frame = self._usage[n] = _frame(_event(doc))
        return frame

    def tail(self, n: int, usage: bool) -> bytes:
        """What follows the last content chunk."""
        return self.finish + (self.usage(n) if usage else b"") + self.done

    def whole(self, n: int, usage: bool) -> bytes:
        key = (n, usage)
        data = self._whole.get(key)
        if data is None:
            data = self._whole[key] = SSE_HEAD + self.role + self.content * n + self.tail(n, usage)
        return data

    def completion(self, n: int) -> bytes:
        data = self._json.get(n)
        if data is None:
            doc = {
                "id": CHUNK_ID,
                "object": "chat.completion",
                "created": CREATED,
                "model": self.served,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": TEXT * n},
                        "logprobs": None,
                        "finish_reason": "length",
                    }
                ],
                "usage": {
                    "prompt_tokens": PROMPT_TOKENS,
                    "total_tokens": PROMPT_TOKENS + n,
                    "completion_tokens": n,
                },
            }
            data = self._json[n] = _response("200 OK", b"application/json", orjson.dumps(doc))
        return data


class Engine:
    """What all connections share: the options, the catalogue, and the running count."""

    def __init__(self, opts: EngineOptions) -> None:
        self.opts = opts
        self.cat = Catalogue(opts)
        self.running = 0
        self.served_total = 0

    def metrics(self) -> bytes:
        labels = f'engine="0",model_name="{self.opts.served}"'
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {float(self.running)}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} 0.0\n"
            "# TYPE vllm:cache_config_info gauge\n"
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
        )
        return _response("200 OK", b"text/plain; version=0.0.4", text.encode())


class Connection(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection; requests are answered one at a time, in order."""

    __slots__ = ("_buf", "_busy", "_engine", "_task", "_transport")

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._buf = b""
        self._busy = False
        self._task: asyncio.Task[None] | None = None
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
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
            self._handle(method, target.split(b"?", 1)[0], headers, body, keep)

    def _handle(
        self, method: bytes, path: bytes, headers: dict[bytes, bytes], body: bytes, keep: bool
    ) -> None:
        transport = self._transport
        assert transport is not None
        cat = self._engine.cat
        if method == b"POST" and path == b"/v1/chat/completions":
            self._chat(headers, body, keep)
            return
        if method != b"GET":
            answer = cat.not_found
        elif path == b"/health":
            answer = cat.health
        elif path == b"/v1/models":
            answer = cat.models
        elif path == b"/version":
            answer = cat.version
        elif path == b"/metrics":
            answer = self._engine.metrics()
        else:
            answer = cat.not_found
        transport.write(answer)
        if not keep:
            transport.close()

    def _chat(self, headers: dict[bytes, bytes], body: bytes, keep: bool) -> None:
        transport = self._transport
        assert transport is not None
        engine = self._engine
        opts = engine.opts
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            doc = None
        if type(doc) is not dict:
            transport.write(engine.cat.bad_request)
            transport.close()
            return
        meta = doc.get("metadata")
        meta = meta if type(meta) is dict else {}
        n = _number(headers.get(b"x-bench-chunks"))
        if n is None:
            n = _number(doc.get("max_tokens"))
        if n is None:
            n = _number(doc.get("max_completion_tokens"))
        chunks = max(1, min(MAX_CHUNKS, int(n if n is not None else opts.chunks)))
        ttft = _number(headers.get(b"x-bench-ttft-ms"))
        ttft = ttft if ttft is not None else _number(meta.get("bench_ttft_ms"))
        ttft = (ttft if ttft is not None else opts.ttft_ms) / 1000
        delay = _number(headers.get(b"x-bench-delay-ms"))
        delay = delay if delay is not None else _number(meta.get("bench_delay_ms"))
        delay = (delay if delay is not None else opts.delay_ms) / 1000
        stream = doc.get("stream") is True
        options = doc.get("stream_options")
        usage = stream and type(options) is dict and options.get("include_usage") is True
        engine.served_total += 1
        if ttft > 0 or (stream and delay > 0):
            self._busy = True
            self._task = asyncio.get_running_loop().create_task(
                self._slow(chunks, stream, usage, ttft, delay, keep)
            )
            return
        cat = engine.cat
        if not stream:
            transport.write(cat.completion(chunks))
        elif opts.coalesce:
            transport.write(cat.whole(chunks, usage))
        else:
            write = transport.write
            write(SSE_HEAD + cat.role)
            content = cat.content
            for _ in range(chunks):
                write(content)
            write(cat.tail(chunks, usage))
        if not keep:
            transport.close()

    async def _slow(
        self, chunks: int, stream: bool, usage: bool, ttft: float, delay: float, keep: bool
    ) -> None:
        engine = self._engine
        cat = engine.cat
        engine.running += 1
        try:
            if stream:
                self._write(SSE_HEAD + cat.role)
            if ttft > 0:
                await asyncio.sleep(ttft)
            if not stream:
                self._write(cat.completion(chunks))
            else:
                for i in range(chunks):
                    if i and delay > 0:
                        await asyncio.sleep(delay)
                    self._write(cat.content)
                self._write(cat.tail(chunks, usage))
        except asyncio.CancelledError:
            return
        finally:
            engine.running -= 1
            self._task = None
        self._busy = False
        if self._transport is not None:
            if keep:
                self._process()
            else:
                self._transport.close()

    def _write(self, data: bytes) -> None:
        if self._transport is None:
            raise asyncio.CancelledError
        self._transport.write(data)


def _dechunk(buf: bytes, pos: int) -> tuple[bytes, bytes] | None:
    """A complete chunked body at ``pos`` and what follows it; None while incomplete."""
    parts: list[bytes] = []
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(buf[pos:eol].split(b";", 1)[0], 16)
        pos = eol + 2
        if size == 0:
            end = buf.find(b"\r\n", pos)  # no trailers expected: an empty line
            if end < 0:
                return None
            return b"".join(parts), buf[end + 2 :]
        if len(buf) < pos + size + 2:
            return None
        parts.append(buf[pos : pos + size])
        pos += size + 2


async def serve(host: str, port: int, opts: EngineOptions) -> None:
    """Serve until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    engine = Engine(opts)
    server = await loop.create_server(
        lambda: Connection(engine), host, port, reuse_address=True, backlog=1024
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bound = server.sockets[0].getsockname()[1]
    print(f"fake engine listening on http://{host}:{bound}", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.fake_engine", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="0: any free port (printed)")
    parser.add_argument("--served", default="tiny", help="the model id the engine serves")
    parser.add_argument("--chunks", type=int, default=16, help="content chunks per answer")
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="time to the first token")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="delay between chunks")
    parser.add_argument("--coalesce", action="store_true", help="write a stream in one piece")
    args = parser.parse_args(argv)
    opts = EngineOptions(
        served=args.served,
        chunks=args.chunks,
        ttft_ms=args.ttft_ms,
        delay_ms=args.delay_ms,
        coalesce=args.coalesce,
    )
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(serve(args.host, args.port, opts))
    else:
        uvloop.run(serve(args.host, args.port, opts))


if __name__ == "__main__":
    main()
