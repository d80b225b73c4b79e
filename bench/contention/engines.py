"""The engines the contention benchmark runs behind the gateway, each a launched deployment.

- ``fake``: the launchable fake engine (``slow_park.py``) parked by vLLM's sleep mode, at the
  costs vLLM published for a model a coding agent runs (Qwen3-Coder-30B-A3B, one A100, sleep
  level 1, vLLM 0.11.0: a sleep 2.78 s, a wake 2.85-2.89 s; its cold start 47.3-47.6 s:
  blog.vllm.ai/2025/10/26/sleep-mode.html, the data of its figures in
  vllm-project/vllm-project.github.io, assets/figures/2025-vllm-sleep-mode/). Each deployment's
  first start, before the measured window, is the fake's own (``FAKE_START_S``), not vLLM's
  47 s: it is paid once, and would take most of the run. A request ``take:S`` generates for S
  seconds; its first chunk comes at once (its wait is the time to that chunk).
- ``llamacpp``: real llama-server b10798 processes (the tests' build) serving the tests' tiny
  random-weight GGUF, started and stopped by the gateway at their own cost (a one-model
  llama-server has no park: a switch stops it and starts the other). A request generates
  ``max_tokens`` tokens (the model never ends sooner).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = ["FAKE_START_S", "Engine", "Fake", "Llama", "llama"]

FAKE_START_S = 2.0
"""The fake's start (``--slow-start``), paid before the measured window."""


class Engine(Protocol):
    @property
    def key(self) -> str: ...

    @property
    def label(self) -> str: ...

    def deployment(self, name: str, served: str, memory: str) -> dict[str, Any]: ...

    def body(self, model: str) -> dict[str, Any]: ...

    def answered(self, text: str, served: str) -> bool:
        """Whether ``text`` (a whole streamed answer) is a whole answer from ``served``."""
        ...


@dataclass(frozen=True, slots=True)
class Fake:
    sleep_s: float = 2.78
    wake_s: float = 2.87
    start_s: float = FAKE_START_S
    gen_s: float = 1.0
    key: str = "fake"

    @property
    def label(self) -> str:
        return (
            f"fake engine, vLLM sleep-mode costs (sleep {self.sleep_s:g} s, wake "
            f"{self.wake_s:g} s), {self.gen_s:g} s generations"
        )

    def deployment(self, name: str, served: str, memory: str) -> dict[str, Any]:
        command = [sys.executable, "-m", "bench.contention.slow_park", "--served", served]
        command += ["--slow-start", f"{self.start_s:g}", "--slow-sleep", f"{self.sleep_s:g}"]
        command += ["--slow-wake", f"{self.wake_s:g}"]
        return {
            "name": name,
            "engine": "vllm",
            "engine_version": "0.31.0",
            "served_model": served,
            "memory": {"ready": memory},
            "lifecycle": {"park": "sleep", "start_estimate": f"{self.wake_s:g}s"},
            "instances": [{"launch": {"command": command, "startup_timeout": "60s"}}],
        }

    def body(self, model: str) -> dict[str, Any]:
        return {
            "model": model,
            "messages": [{"role": "user", "content": f"take:{self.gen_s:g}"}],
            "stream": True,
        }

    def answered(self, text: str, served: str) -> bool:
        return f'"content":"from {served}"' in text and text.endswith("data: [DONE]\n\n")


@dataclass(frozen=True, slots=True)
class Llama:
    binary: Path
    model: Path
    tokens: int
    key: str = "llamacpp"

    @property
    def label(self) -> str:
        return f"llama-server b10798, tiny GGUF, its own start and stop, {self.tokens} tokens"

    def deployment(self, name: str, served: str, memory: str) -> dict[str, Any]:
        command = [str(self.binary), "-m", str(self.model), "-a", served, "-c", "8192"]
        command += ["--parallel", "4", "-t", "1"]
        return {
            "name": name,
            "engine": "llamacpp",
            "engine_version": "b10798",
            "served_model": served,
            "memory": {"ready": memory},
            "lifecycle": {"start_estimate": "1s"},
            "instances": [{"launch": {"command": command, "startup_timeout": "60s"}}],
        }

    def body(self, model: str) -> dict[str, Any]:
        return {
            "model": model,
            "messages": [{"role": "user", "content": "Write on."}],
            "max_tokens": self.tokens,
            "stream": True,
        }

    def answered(self, text: str, served: str) -> bool:
        return '"finish_reason":"length"' in text and text.endswith("data: [DONE]\n\n")


def llama(work: Path, tokens: int) -> Llama:
    """llama-server b10798 (built once and cached) and the tests' tiny model, written here."""
    from contract.engines.llamacpp import ensure_llama_server
    from contract.engines.tiny_gguf import write_tiny_gguf

    model = write_tiny_gguf(work / "tiny.gguf", context_length=8192)
    return Llama(ensure_llama_server(), model, tokens)
