"""The floor under the gateway: a relay that does only what no gateway can skip.

``aiohttp.web`` for the client and the gateway's own engine client (`EngineClient`) for the
engine, with uvloop: it reads the client's body, asks the engine for a stream (as the gateway
does, usage included), and reads that stream without looking at it: to its end, answering a
fixed small JSON document, when the client asked for no stream; else writing each read to the
client as it came, from the engine connection's reads (as the gateway's `Pump` does; unlike
it, without a bound on what a client that stops reading makes it hold). No key, no IDs, no
validation, no verification, no assembling, no figures, no log line. What the gateway costs
above it is its own work (``bench.perf.ab --floor``).

Run: ``python -m bench.perf.floor_relay PORT ENGINE_URL``; ``GET /health`` answers 200.
"""

from __future__ import annotations

import asyncio
import sys

import orjson
from aiohttp import web
from yarl import URL

from capyctl_gateway._cli_common import use_uvloop
from capyctl_gateway._engine_client import EngineClient

__all__ = ["main"]

_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}


async def _serve(port: int, engine: URL) -> None:
    client = EngineClient(connect_timeout=10)
    chat_url = engine.with_path("/v1/chat/completions")

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        streamed = body.get("stream") is True
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        answer = await client.post(chat_url, data=orjson.dumps(body), headers=_HEADERS)
        if not streamed:
            while await answer.content.readany():
                pass
            answer.release()
            return web.Response(body=b'{"relayed":true}', content_type="application/json")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(await answer.content.readany())
        transport = request.transport
        assert transport is not None

        def write(parts: list[bytes]) -> None:  # each read as it came, unlooked at
            data = b"".join(parts)
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))

        body = answer.content
        body.attach(write)  # from the engine connection's reads, as the gateway's Pump
        while not body.ended():
            await body.wait()
        body.detach()
        answer.release()
        await out.write_eof()
        return out

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    use_uvloop()
    asyncio.run(_serve(int(args[0]), URL(args[1])))


if __name__ == "__main__":
    main()
