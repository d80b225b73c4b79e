"""What the gateway knows of each engine kind it serves, in one table.

The kind itself is the SDK's `EngineKind` (one definition for the SDK, both CLIs and the
gateway); the SDK builds its adapter (`adapter_for`). What only the gateway needs, how a kind
streams and what it honours, lives here, keyed by that kind. A kind that is not in `FACTS` is
not served by the gateway (the SDK's health-only kinds), and the configuration refuses it.

Imports nothing of the gateway: every room may read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from canopyx_provider import EngineKind

__all__ = ["FACTS", "EngineFacts", "EngineKind", "facts", "served_kinds"]


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """How one engine kind speaks the chat API, as far as the gateway relies on it."""

    delta_keys: frozenset[str]
    """The keys a streamed chunk's delta may carry (the spec's streamed-field table)."""
    reasoning_key: str
    """The delta key under which the engine streams its reasoning text."""
    honours_cache_salt: bool
    """The engine partitions its prefix cache by ``cache_salt``."""
    closes_after_stream: bool = False
    """The engine closes its connection after every streamed answer without saying so; the
    gateway asks it to close (``Connection: close``) so the connection is never reused."""


FACTS: dict[EngineKind, EngineFacts] = {
    EngineKind.VLLM: EngineFacts(
        delta_keys=frozenset({"role", "content", "reasoning", "tool_calls"}),
        reasoning_key="reasoning",
        honours_cache_salt=True,
    ),
    EngineKind.SGLANG: EngineFacts(
        delta_keys=frozenset({"role", "content", "reasoning_content", "tool_calls"}),
        reasoning_key="reasoning_content",
        honours_cache_salt=True,
    ),
    EngineKind.LLAMACPP: EngineFacts(
        delta_keys=frozenset({"role", "content", "reasoning_content", "tool_calls"}),
        reasoning_key="reasoning_content",
        honours_cache_salt=False,
        # Measured on llama-server b10798: the request after a stream on a reused connection
        # met a closed socket, 10 times in 10.
        closes_after_stream=True,
    ),
    EngineKind.TENSORFOLD: EngineFacts(
        delta_keys=frozenset({"role", "content", "reasoning_content", "tool_calls"}),
        reasoning_key="reasoning_content",
        honours_cache_salt=False,
    ),
}


def facts(kind: EngineKind) -> EngineFacts:
    return FACTS[kind]


def served_kinds() -> tuple[EngineKind, ...]:
    return tuple(FACTS)
