"""What the gateway knows of each engine kind it serves, in one table.

The kind itself is the SDK's `EngineKind` (one definition for the SDK, both CLIs and the
gateway); the SDK builds its adapter (`adapter_for`). What only the gateway needs, how a kind
streams and what it honours, lives here, keyed by that kind. A kind that is not in `FACTS` is
not served by the gateway (the SDK's health-only kinds), and the configuration refuses it.

Imports nothing of the gateway: every room may read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from canopyx_provider import EngineKind

__all__ = [
    "DEVICES",
    "FACTS",
    "FIGURE_OBJECTS",
    "EngineFacts",
    "EngineKind",
    "facts",
    "gpu_present",
    "launch_problem",
    "served_kinds",
]

DEVICES = Path("/dev")
GPU_DEVICES = ("nvidiactl", "nvidia0", "kfd")
"""NVIDIA's driver (its control device, the first GPU's) and ROCm's compute device."""


def gpu_present(devices: Path = DEVICES) -> bool:
    """Whether this machine has a GPU its engines can park on: an NVIDIA or ROCm device file
    under ``devices``. (``CUDA_VISIBLE_DEVICES`` is not asked: it can name GPUs that are not
    there, and an instance's ``launch.env`` may set its own.)"""
    return any((devices / name).exists() for name in GPU_DEVICES)


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
    forced_flags: tuple[str, ...] = ()
    """Flags a launched engine always gets: what the gateway's figures and the SDK need."""
    can_sleep: bool = False
    """The gateway can park this engine with its process up (it can only stop it otherwise)."""
    sleep_flags: tuple[str, ...] = ()
    """Flags a launched engine needs to be parked (with ``park: sleep``, or ``auto`` on a GPU)."""
    sleep_env: tuple[tuple[str, str], ...] = ()
    """Environment a launched engine needs to be parked (as ``sleep_flags``)."""
    park_by: str | None = None
    """How a park keeps its process up (``_deployments/parking.py`` has one driver each):
    ``sleep`` (vLLM's sleep mode), ``release`` (SGLang's memory release); None where it
    cannot (a llama.cpp router unloads its model instead)."""
    figures_in: str | None = None
    """The key of the engine's own figures in an answer's chunks (``_relay/figures.py`` reads
    each such object one way): vLLM's ``metrics``, TensorFold's ``tensorfold``, llama.cpp's
    ``timings``; None where it sends none."""
    cached_only_when_some: bool = False
    """The engine reports ``cached_tokens`` only when some were cached: an answer without it
    says nothing of the cache (not 0)."""
    chunk_keys: frozenset[str] = frozenset()
    """A chunk's own fields beside its frame and ``usage`` (the spec's streamed-field table,
    and what the engine sends at the tested versions): any other ends the stream unverified."""
    null_chunk_keys: frozenset[str] = frozenset()
    """Fields the engine writes into every chunk's first one as null (vLLM's token ids, which
    no request the gateway forwards asks for): relayed only while null."""
    finish_reasons: frozenset[str] = frozenset({"stop", "length", "tool_calls"})
    """The finish reasons the engine's sources say it sends (a tool call answer's
    ``tool_calls`` included): any other ends the stream unverified."""
    warm_flag: str | None = None
    """The flag that names where a launched engine saves its cache for a warm wake
    (llama.cpp's ``--slot-save-path``); None where the gateway keeps none for it."""


FACTS: dict[EngineKind, EngineFacts] = {
    EngineKind.VLLM: EngineFacts(
        delta_keys=frozenset({"role", "content", "reasoning", "tool_calls"}),
        reasoning_key="reasoning",
        honours_cache_salt=True,
        forced_flags=("--enable-per-request-metrics",),
        # Sleep mode: its routes exist only in development mode, and the CPU build refuses the
        # flag at startup (so park: auto asks for it only where there is a GPU).
        can_sleep=True,
        sleep_flags=("--enable-sleep-mode",),
        sleep_env=(("VLLM_SERVER_DEV_MODE", "1"),),
        park_by="sleep",
        figures_in="metrics",
        # system_fingerprint on the usage chunk (captured from 0.31.0; not in the spec's table)
        chunk_keys=frozenset({"metrics", "system_fingerprint"}),
        null_chunk_keys=frozenset({"prompt_token_ids", "prompt_text"}),
        # vllm/v1/engine: FINISH_REASON_STRINGS
        finish_reasons=frozenset({"stop", "length", "tool_calls", "abort", "error", "repetition"}),
    ),
    EngineKind.SGLANG: EngineFacts(
        delta_keys=frozenset({"role", "content", "reasoning_content", "tool_calls"}),
        reasoning_key="reasoning_content",
        honours_cache_salt=True,
        # --enable-metrics: the SDK's SGLang adapter reads its load from /metrics.
        forced_flags=("--enable-cache-report", "--enable-metrics"),
        # Memory release: needs --enable-memory-saver (without it a release frees nothing
        # and says nothing), and a GPU (torch_memory_saver): park: auto asks for it there.
        can_sleep=True,
        sleep_flags=("--enable-memory-saver",),
        park_by="release",
        cached_only_when_some=True,
        # FINISH_MATCHED_* say stop, FINISH_LENGTH length, FINISH_ABORT abort
        finish_reasons=frozenset({"stop", "length", "tool_calls", "abort"}),
    ),
    EngineKind.LLAMACPP: EngineFacts(
        delta_keys=frozenset({"role", "content", "reasoning_content", "tool_calls"}),
        reasoning_key="reasoning_content",
        honours_cache_salt=False,
        # Measured on llama-server b10798: the request after a stream on a reused connection
        # met a closed socket, 10 times in 10.
        closes_after_stream=True,
        forced_flags=("--metrics",),
        figures_in="timings",
        chunk_keys=frozenset({"system_fingerprint", "timings"}),
        warm_flag="--slot-save-path",
    ),
    EngineKind.TENSORFOLD: EngineFacts(
        delta_keys=frozenset({"role", "content", "reasoning_content", "tool_calls"}),
        reasoning_key="reasoning_content",
        honours_cache_salt=False,
        figures_in="tensorfold",
        chunk_keys=frozenset({"exact_mode", "tensorfold", "speculative"}),
    ),
}


FIGURE_OBJECTS = tuple(
    dict.fromkeys(f.figures_in for f in FACTS.values() if f.figures_in is not None)
)
"""Every key under which an engine sends its own figures in a chunk (``metrics``, ``timings``,
``tensorfold``): what the verifier keeps of a chunk beyond its frame."""

_PLACEMENT = ("--host", "--port")
_PLACEMENT_ENV = ("LLAMA_ARG_HOST", "LLAMA_ARG_PORT", "VLLM_HOST_IP", "SGLANG_HOST_IP")


def launch_problem(kind: EngineKind, command: list[str], env: dict[str, str]) -> str | None:
    """Why the gateway will not launch ``command`` for ``kind``: it places the engine itself
    (host and port) and keeps the flags it forces on."""
    for arg in command[1:]:
        name = arg.split("=", 1)[0]
        if name in _PLACEMENT:
            return f"sets {name}; the gateway chooses the engine's host and port itself"
        for flag in FACTS[kind].forced_flags:
            if name in ("--no-" + flag.removeprefix("--"), "--disable-" + flag.removeprefix("--")):
                return f"turns off {flag}, which the gateway always sets"
    for key in env:
        if key in _PLACEMENT_ENV:
            return f"env sets {key}; the gateway chooses the engine's host and port itself"
    return None


def facts(kind: EngineKind) -> EngineFacts:
    return FACTS[kind]


def served_kinds() -> tuple[EngineKind, ...]:
    return tuple(FACTS)
