"""CPU per streamed chunk of a Messages stream beside chat's, on the fake engine's exact bytes.

For one text chunk read from the engine, chat's relay decodes and verifies it and frames the
engine's own bytes for the client (`BlockReader.relay`); the Messages relay decodes and verifies
it the same way but folds it into the Message (`BlockReader.collect` into a `MessageBuilder`),
which makes a ``content_block_delta`` event and keeps the text for a whole Message. The
difference is what the translation adds per streamed event. Best cases (hot caches, no I/O), as
``chunk_cost`` and ``responses_cost``; the reads and writes on top are the same for both.

Run: ``.venv/bin/python -m bench.perf.messages_cost [--n 200000]``
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from capyctl_gateway._engines import EngineKind
from capyctl_gateway._messages.build import MessageBuilder
from capyctl_gateway._messages.request import Asked
from capyctl_gateway._relay.blocks import BlockReader
from capyctl_gateway._relay.verify import ChunkVerifier

from .chunk_cost import _payload, _per_call_us
from .fake_engine import Catalogue, EngineOptions

__all__ = ["main"]


def _reader() -> BlockReader:
    return BlockReader(ChunkVerifier(EngineKind.VLLM, served="tiny", public="bench"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.messages_cost", description=__doc__)
    parser.add_argument("--n", type=int, default=200_000, help="chunks per figure")
    args = parser.parse_args(argv)
    n = args.n
    cat = Catalogue(EngineOptions())
    role, text = _payload(cat.role), _payload(cat.content)
    block16 = text * 16

    chat = _reader()
    chat.relay(role, 0.0)
    chat.relay(text, 0.0)  # the template

    def builder() -> tuple[BlockReader, MessageBuilder]:
        reader = _reader()
        b = MessageBuilder(Asked(), model="bench", max_bytes=2**62, streaming=True)
        reader.collect(role, 0.0, b)
        reader.collect(text, 0.0, b)
        b.take()
        return reader, b

    one_r, one_b = builder()
    many_r, many_b = builder()

    def message_one() -> None:
        one_r.collect(text, 1.0, one_b)
        one_b.take()

    def message_many() -> None:
        many_r.collect(block16, 1.0, many_b)
        many_b.take()

    steps: list[tuple[str, Callable[[], object], int]] = [
        ("chat: relay one text chunk (verified, framed)", lambda: chat.relay(text, 1.0), 1),
        ("messages: fold one text chunk, its delta event made", message_one, 1),
        ("chat: 16 text chunks in one read (per chunk)", lambda: chat.relay(block16, 1.0), 16),
        ("messages: 16 text chunks in one read (per chunk)", message_many, 16),
    ]
    rows = [(name, _per_call_us(fn, n // per) / per) for name, fn, per in steps]
    print("| step | µs per chunk |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
