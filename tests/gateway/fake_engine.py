"""A fault-injecting fake engine on a real loopback socket, for the gateway's tests.

It answers ``POST /v1/chat/completions`` from a script, records what it received, and notices
when the gateway closes the connection before the script is done (the signal that makes a real
engine stop). It never stands in for a real engine's behaviour: the live tests do that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


@dataclass(frozen=True)
class Pause:
    """Wait this long before the next item (the engine being slow, not test synchronisation)."""

    seconds: float


@dataclass(frozen=True)
class Hold:
    """Stop writing until the connection is closed by the other side."""


@dataclass(frozen=True)
class Gate:
    """Write nothing more until the test opens this (having seen what came before arrive)."""

    opened: asyncio.Event


@dataclass(frozen=True)
class Flood:
    """Write ``item`` again and again until the reader has stopped reading, then set
    ``stalled`` (at most ``limit`` copies; ``written`` counts them)."""

    item: bytes
    stalled: asyncio.Event
    limit: int = 4096
    written: list[int] = field(default_factory=lambda: [0])


@dataclass(frozen=True)
class Drop:
    """Abort the connection at once, mid-answer (the engine died)."""


@dataclass(frozen=True)
class Reply:
    """A plain (non-stream) answer."""

    status: int
    body: bytes
    content_type: str = "application/json"


Item = bytes | Pause | Hold | Gate | Flood | Drop


@dataclass
class Received:
    headers: dict[str, str]
    body: dict[str, Any]
    peer: Any = None
    """The gateway's end of the connection the request came on."""


@dataclass
class FakeEngine:
    served: str = "tiny"
    script: Sequence[Item] | Reply = ()
    received: list[Received] = field(default_factory=list)
    hung_up: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the gateway closed a connection before the script was done."""
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once a request has arrived."""
    finished: int = 0
    url: str = ""
    # What the engine reports to the collector (vLLM-shaped):
    running: int = 0
    waiting: int = 0
    process_start: float = 1796000000.0
    publishes_start: bool = True
    """Whether ``/metrics`` carries ``process_start_time_seconds`` (the start marker)."""
    healthy: bool = True
    health_hold: asyncio.Event | None = None
    """Set: /health answers only once it is set (the collector's first look stays open)."""
    metrics_served: bool = True
    """False: /metrics answers 503, so the collector has no fresh load sample of it."""
    kv_usage: float = 0.0
    """What ``vllm:kv_cache_usage_perc`` says (0..1)."""
    prefix_cache: tuple[float, float] | None = None
    """vLLM's prefix-cache counters (queried and hit tokens) when set; absent otherwise."""

    async def health(self, request: web.Request) -> web.Response:
        if self.health_hold is not None:
            await self.health_hold.wait()
        return web.Response(status=200 if self.healthy else 503)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.31.0"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.served, "object": "model"}]}
        )

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.metrics_served:
            return web.Response(status=503)
        labels = f'engine="0",model_name="{self.served}"'
        marker = f"process_start_time_seconds {self.process_start}\n"
        text = (
            (marker if self.publishes_start else "")
            + f"vllm:num_requests_running{{{labels}}} {float(self.running)}\n"
            f"vllm:num_requests_waiting{{{labels}}} {float(self.waiting)}\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} {self.kv_usage}\n"
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
        )
        if self.prefix_cache is not None:
            queried, hit = self.prefix_cache
            text += f"vllm:prefix_cache_queries_total{{{labels}}} {queried}\n"
            text += f"vllm:prefix_cache_hits_total{{{labels}}} {hit}\n"
        return web.Response(text=text, content_type="text/plain")

    decision: Reply | Hold | None = None
    """How /v1/systemone answers: a Reply, Hold, or (None) the spec's example answer."""

    async def decide(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.received.append(Received(dict(request.headers), body))
        self.arrived.set()
        if isinstance(self.decision, Hold):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.hung_up.set()
                raise
        if isinstance(self.decision, Reply):
            return web.Response(
                status=self.decision.status,
                body=self.decision.body,
                content_type=self.decision.content_type,
            )
        return web.json_response(decision_answer(body, model=self.served))

    tokenizer: Reply | None = None
    """How /tokenize and /apply-template answer: a Reply, or (None) as vLLM and llama.cpp do,
    counting a prompt's characters as its tokens."""

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's chat form (``messages``: the template's prompt counted) or llama.cpp's
        (``content``: its token ids)."""
        body = orjson.loads(await request.read())
        self.received.append(Received(dict(request.headers), {"path": request.path, **body}))
        if self.tokenizer is not None:
            return web.Response(
                status=self.tokenizer.status,
                body=self.tokenizer.body,
                content_type=self.tokenizer.content_type,
            )
        if "content" in body:
            return web.json_response({"tokens": list(range(len(body["content"])))})
        count = len(template_of(body))
        return web.json_response({"count": count, "max_model_len": 4096, "tokens": [0] * count})

    async def apply_template(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.received.append(Received(dict(request.headers), {"path": request.path, **body}))
        if self.tokenizer is not None:
            return web.Response(status=self.tokenizer.status, body=self.tokenizer.body)
        return web.json_response({"prompt": template_of(body)})

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/apply-template", self.apply_template)
        app.router.add_post("/v1/systemone", self.decide)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.received.append(Received(dict(request.headers), body, peer))
        self.arrived.set()
        if isinstance(self.script, Reply):
            return web.Response(
                status=self.script.status,
                body=self.script.body,
                content_type=self.script.content_type,
            )
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        try:
            for item in self.script:
                if isinstance(item, Pause):
                    await asyncio.sleep(item.seconds)
                elif isinstance(item, Hold):
                    await asyncio.Event().wait()
                elif isinstance(item, Gate):
                    await item.opened.wait()
                elif isinstance(item, Flood):
                    await _flood(request, out, item)
                elif isinstance(item, Drop):
                    assert request.transport is not None
                    request.transport.abort()
                    return out
                else:
                    await out.write(item)
            await out.write_eof()
            self.finished += 1
        except (asyncio.CancelledError, ConnectionResetError):
            self.hung_up.set()
            raise
        return out


async def _flood(request: web.Request, out: web.StreamResponse, flood: Flood) -> None:
    """The reader has stopped when a write stays buffered on our side while the loop turns
    over (the gateway runs on this loop in the tests: a reader that still reads takes it
    within a turn or two). A reader that never stops reading makes the flood run to its limit,
    which the tests see as a failure to bound."""
    transport = request.transport
    assert transport is not None
    for _ in range(flood.limit):
        await out.write(flood.item)
        flood.written[0] += 1
        for _turn in range(20):
            if not transport.get_write_buffer_size():
                break
            await asyncio.sleep(0)  # one turn of the loop
        else:
            flood.stalled.set()
            return


def event(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else orjson.dumps(obj).decode()
    return f"data: {data}\n\n".encode()


DONE = b"data: [DONE]\n\n"


def chunk(
    *,
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    cid: str = "chatcmpl-1",
    model: str = "tiny",
    choices: list[Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    c: dict[str, Any] = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": 1796000000,
        "model": model,
    }
    if choices is None:
        choices = [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}]
    c["choices"] = choices
    c.update(extra)
    return c


def vllm_stream(
    texts: Sequence[str] = ("Hel", "lo", "!"),
    *,
    usage: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
) -> list[Item]:
    """A vLLM 0.31-shaped stream: opening role chunk, text, finish, usage chunk, [DONE]."""
    items: list[Item] = [event(chunk(delta={"role": "assistant", "content": ""}))]
    items += [event(chunk(delta={"content": t})) for t in texts]
    items.append(event(chunk(delta={}, finish="stop")))
    if usage is not None or metrics is not None:
        extra: dict[str, Any] = {"usage": usage or {}}
        if metrics is not None:
            extra["metrics"] = metrics
        items.append(event(chunk(choices=[], **extra)))
    items.append(DONE)
    return items


def decision_answer(body: dict[str, Any], *, model: str) -> dict[str, Any]:
    """An answer in the shape of the spec's example, one entry per question asked."""
    answers: dict[str, Any] = {}
    for qid, q in body.get("questions", {}).items():
        kind = q.get("type")
        if kind == "noul":
            answers[qid] = {"type": "noul", "noul": 0.6226}
        elif kind == "choice":
            options = list(q.get("criteria") or {})
            probs = {o: round(1 / len(options), 4) for o in options}
            answers[qid] = {
                "type": "choice",
                "choice": options[0],
                "confidence": 0.9255,
                "probabilities": probs,
            }
        else:
            levels = q.get("criteria") or []
            answers[qid] = {
                "type": "score",
                "score": 1.1224,
                "confidence": 0.48,
                "legend": {str(i): v for i, v in enumerate(levels)},
                "probabilities": {str(i): round(1 / len(levels), 2) for i in range(len(levels))},
            }
    return {"answers": answers, "model": model, "usage": {"input_tokens": 87, "output_tokens": 0}}


def template_of(body: dict[str, Any]) -> str:
    """The fake engine's chat template: each message's role and content on a line, the tools'
    names after them."""
    lines = [f"{m['role']}: {m.get('content')}" for m in body.get("messages", ())]
    lines += [t["function"]["name"] for t in body.get("tools") or ()]
    return "\n".join(lines) + "\nassistant:"
