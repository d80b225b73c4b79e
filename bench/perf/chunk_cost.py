"""CPU per streamed chunk of the gateway's pure per-chunk steps, on the fake engine's exact bytes.

These are the steps the relay runs for every chunk an engine streams: SSE decoding, the
verifier (which parses the chunk, checks it, tests it for repeated keys by re-serialising it,
and renames the model in the engine's own bytes for the client); and the streaming path's
template match, which relays a text chunk that differs from an already verified one only in its
text, without parsing it whole. Chunks that are not text (the opening role, the finish, usage)
always take the full check. The figures are best cases (hot caches, no I/O); the end-to-end
figure per extra chunk from ``bench.perf.run`` adds aiohttp's reads and writes on top.

Run: ``.venv/bin/python -m bench.perf.chunk_cost [--n 200000]``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import orjson

from capyctl_gateway._engines import EngineKind
from capyctl_gateway._relay.sse import SSEDecoder
from capyctl_gateway._relay.verify import ChunkVerifier

from .fake_engine import Catalogue, EngineOptions

__all__ = ["main"]


def _per_call_us(fn: Callable[[], object], n: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def _payload(frame: bytes) -> bytes:
    """The SSE event inside one HTTP chunk."""
    return frame.split(b"\r\n", 1)[1][:-2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.chunk_cost", description=__doc__)
    parser.add_argument("--n", type=int, default=200_000, help="calls per figure")
    args = parser.parse_args(argv)
    n = args.n
    cat = Catalogue(EngineOptions())
    event = _payload(cat.content)
    raw = event.removeprefix(b"data: ").removesuffix(b"\n\n")
    doc = orjson.loads(raw)
    role_raw = _payload(cat.role).removeprefix(b"data: ").removesuffix(b"\n\n")
    verifier = ChunkVerifier(EngineKind.VLLM, served="tiny", public="bench")
    verifier.check(role_raw, 0.0)
    relayer = ChunkVerifier(EngineKind.VLLM, served="tiny", public="bench")
    relayer.relay(role_raw, 0.0)
    relayer.relay(raw, 0.5)  # the first text chunk: checked in full, becomes the template
    opener = ChunkVerifier(EngineKind.VLLM, served="tiny", public="bench")  # never a template
    decoder = SSEDecoder()
    block16 = event * 16
    head, blank = b"data: ", b"\n\n"
    steps: list[tuple[str, Callable[[], object], int]] = [
        ("SSE decode, one event per read", lambda: decoder.feed(event), 1),
        ("SSE decode, 16 events per read (per event)", lambda: decoder.feed(block16), 16),
        (
            "verifier.check (parse, checks, repeated-key test, model renamed)",
            lambda: verifier.check(raw, 1.0),
            1,
        ),
        ("  of which orjson.loads", lambda: orjson.loads(raw), 1),
        ("  of which orjson.dumps (the repeated-key test)", lambda: orjson.dumps(doc), 1),
        (
            "verifier.relay, a role chunk: the full check (framed)",
            lambda: opener.relay(role_raw, 1.0),
            1,
        ),
        ("SSE framing of the relayed chunk", lambda: head + raw + blank, 1),
        (
            "verifier.relay, a text chunk matching the template (framed)",
            lambda: relayer.relay(raw, 1.0),
            1,
        ),
    ]
    rows = [(name, _per_call_us(fn, n // per) / per) for name, fn, per in steps]
    print(f"one content chunk: {len(raw)} bytes of JSON")
    print("| step | µs per chunk |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
