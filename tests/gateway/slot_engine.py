"""A fake llama-server for the warm cache, as a process the gateway launches: ``python -m
tests.gateway.slot_engine -m MODEL [-c CTX] [--parallel N] [--slot-save-path DIR] [fault
flags] --host H --port P``.

It speaks what the gateway's warm cache uses of llama-server b10798 (``_deployments/slots.py``)
the way that build does: ``--slot-save-path`` must name a directory (it exits 1 before
listening otherwise), ``/props`` (the model's path, ``build_info``, the slots and each one's
context), ``/slots`` (``id_task`` once a slot ran a task), ``POST /slots/{id}?action=save`` and
``action=restore`` within ``--slot-save-path`` (501 without it, 400 for a name with a path),
a file written in place (a save cut short leaves a partial one), and a restore that checks only
the file's shape (its magic, that its tokens fit the slot), never the model: a file another
model's engine wrote is taken, as llama.cpp takes it. Its ``/metrics`` are llama.cpp's.

Chat: one token per character of the prompt (its messages' contents joined); a request goes to
the slot whose tokens share the longest start with its prompt (else the least recently used),
and says in its answer (``cached N of M``) and its usage how many it found there. Every slot
action is appended to ``--journal FILE`` (``save 1 NAME``, ``restore 0 NAME``), so a test sees
what the engine was asked.

Faults, from the ``SLOT_ENGINE_FAULTS`` variable (not flags: the flags are in the warm cache's
key), comma-separated: ``save-delay=S`` / ``restore-delay=S`` wait S seconds inside the action;
``save-dies`` writes half the file and exits with status 3 (a kill during a save);
``refuse-restore`` answers every restore 400; ``huge-slots`` answers ``/slots`` with 2 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.gateway.fake_engine import DONE, chunk, event

MAGIC = b"FSLT"
BYTES_PER_TOKEN = 64
BAD_FILE = "Unable to restore slot: No available space in KV cache or invalid slot save file"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("--parallel", "-np", type=int, default=2)
    p.add_argument("--slot-save-path", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--journal", default=None)
    return p


def faults() -> dict[str, str]:
    said = os.environ.get("SLOT_ENGINE_FAULTS", "")
    return dict((f.split("=", 1) + [""])[:2] for f in said.split(",") if f)


class Slot:
    def __init__(self, index: int) -> None:
        self.id = index
        self.text = ""
        self.task: int | None = None
        self.busy = False
        self.used = 0


def build_app(args: argparse.Namespace) -> web.Application:
    slots = [Slot(i) for i in range(args.parallel)]
    per_slot = args.ctx_size // args.parallel
    tasks = itertools.count(1)
    counts = {"prompt": 0, "cached": 0, "predicted": 0}
    save_dir = Path(args.slot_save_path) if args.slot_save_path else None
    fault = faults()

    def journal(line: str) -> None:
        if args.journal:
            with open(args.journal, "a") as f:
                f.write(line + "\n")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def props(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": args.model,
                "build_info": "b10798-unknown",
                "total_slots": args.parallel,
                "default_generation_settings": {"n_ctx": per_slot},
            }
        )

    async def metrics(request: web.Request) -> web.Response:
        busy = sum(s.busy for s in slots)
        text = (
            f"llamacpp:prompt_tokens_total {counts['prompt']}\n"
            f"llamacpp:prompt_tokens_cached_total {counts['cached']}\n"
            f"llamacpp:tokens_predicted_total {counts['predicted']}\n"
            f"llamacpp:requests_processing {busy}\nllamacpp:requests_deferred 0\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def slots_doc(request: web.Request) -> web.Response:
        if "huge-slots" in fault:  # past what the gateway reads of an answer
            return web.Response(text="[" + " " * (2 << 20) + "]", content_type="application/json")
        out: list[dict[str, Any]] = []
        for s in slots:
            row: dict[str, Any] = {"id": s.id, "n_ctx": per_slot, "is_processing": s.busy}
            if s.task is not None:
                row |= {"id_task": s.task, "n_prompt_tokens": len(s.text)}
            out.append(row)
        return web.json_response(out)

    async def action(request: web.Request) -> web.Response:
        if save_dir is None:
            return web.json_response({"error": {"code": 501, "message": "no path"}}, status=501)
        slot = slots[int(request.match_info["id"])]
        name = str((await request.json()).get("filename", ""))
        if not name or "/" in name or name in (".", ".."):
            return web.json_response({"error": {"message": "Invalid filename"}}, status=400)
        what = request.query.get("action")
        journal(f"{what} {slot.id} {name}")
        path = save_dir / name
        if what == "save":
            await asyncio.sleep(float(fault.get("save-delay", 0)))
            head = json.dumps({"text": slot.text}).encode()
            body = MAGIC + len(head).to_bytes(4, "little") + head
            body += b"\0" * (BYTES_PER_TOKEN * len(slot.text))
            if "save-dies" in fault:
                path.write_bytes(body[: len(body) // 2])
                os._exit(3)
            path.write_bytes(body)
            return web.json_response({"id_slot": slot.id, "filename": name,
                                      "n_saved": len(slot.text), "n_written": len(body)})  # fmt: skip
        if what == "restore":
            await asyncio.sleep(float(fault.get("restore-delay", 0)))
            try:
                raw = path.read_bytes()
                size = int.from_bytes(raw[4:8], "little")
                text = json.loads(raw[8 : 8 + size])["text"] if raw[:4] == MAGIC else None
            except (OSError, ValueError):
                text = None
            if "refuse-restore" in fault or not isinstance(text, str) or len(text) > per_slot:
                slot.text = ""
                return web.json_response({"error": {"code": 400, "message": BAD_FILE}}, status=400)
            slot.text = text
            return web.json_response({"id_slot": slot.id, "filename": name,
                                      "n_restored": len(text), "n_read": len(raw)})  # fmt: skip
        return web.json_response({"error": {"message": "bad action"}}, status=400)

    def pick(prompt: str) -> tuple[Slot, int]:
        best, shared = None, 0
        for s in slots:
            n = len(os.path.commonprefix([s.text, prompt]))
            if not s.busy and n > shared:
                best, shared = s, n
        if best is None:
            best = min((s for s in slots if not s.busy), key=lambda s: s.used)
        return best, shared

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = "".join(str(m.get("content", "")) for m in body["messages"])
        slot, cached = pick(prompt)
        slot.busy, slot.task = True, next(tasks)
        slot.used = slot.task
        counts["prompt"] += len(prompt) - cached
        counts["cached"] += cached
        model = str(body.get("model", "tiny"))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await out.prepare(request)
            slot.text = prompt
            said = f"cached {cached} of {len(prompt)}"
            await out.write(event(chunk(delta={"role": "assistant", "content": ""}, model=model)))
            await out.write(event(chunk(delta={"content": said}, model=model)))
            await out.write(event(chunk(delta={}, finish="stop", model=model)))
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": len(prompt), "completion_tokens": 1,
                         "total_tokens": len(prompt) + 1,
                         "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
                await out.write(event(chunk(choices=[], usage=usage, model=model)))
            await out.write(DONE)
            await out.write_eof()
            counts["predicted"] += 1
        finally:
            slot.busy = False
        return out

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/props", props)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/slots", slots_doc)
    app.router.add_post("/slots/{id}", action)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def main(argv: list[str] | None = None) -> None:
    args, _ = parser().parse_known_args(argv)
    sys.stdout.write(f"slot engine args: {sys.argv[1:]}\n")
    if args.slot_save_path is not None and not Path(args.slot_save_path).is_dir():
        sys.stdout.write(  # as llama-server b10798 checks it, before it listens
            f'error while handling argument "--slot-save-path": not a directory: '
            f"{args.slot_save_path}\n"
        )
        sys.exit(1)
    sys.stdout.flush()
    # llama-server exits about 1.3 s after SIGTERM (captured), not after aiohttp's 60 s grace
    web.run_app(build_app(args), host=args.host, port=args.port, print=None, shutdown_timeout=0.1)


if __name__ == "__main__":
    main()
