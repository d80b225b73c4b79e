"""Anthropic's request headers (pure): ``anthropic-version`` and ``anthropic-beta``.

``anthropic-version`` is one of `VERSIONS`: ``2023-06-01`` (what Claude Code sends) and
``2026-10-21`` (what the official Python SDK 2.17 sends), whose answers and events are the same
shapes here (the tests hold them to that SDK's types); or absent. Any other is refused by
name. ``anthropic-beta`` (comma-separated, the header given once or more) names betas; each
is one the gateway serves (`BETAS`, with what it does here), or the request is refused naming
it: a feature the gateway does not have is never taken silently.
"""

from __future__ import annotations

from collections.abc import Mapping

from multidict import CIMultiDictProxy

from .._errors import RefusedError, invalid

__all__ = ["BETAS", "VERSIONS", "check_headers"]

VERSIONS = ("2023-06-01", "2026-10-21")
BETAS: Mapping[str, str] = {
    "claude-code-20250219": "names Claude Code: nothing to do",
    "oauth-2025-04-20": "a bearer token instead of a key: the gateway's key as a bearer token",
    "interleaved-thinking-2025-05-14": "thinking between tool calls: the engine's reasoning in "
    "the order it streams it",
    "fine-grained-tool-streaming-2025-05-14": "tool input streamed as the engine makes it, "
    "which the gateway always does",
    "context-management-2025-06-27": "context_management: decided per edit",
    "prompt-caching-2024-07-31": "cache_control: no effect beyond prefix routing",
    "prompt-caching-scope-2026-01-05": "cache scopes: no effect beyond prefix routing",
    "extended-cache-ttl-2025-04-11": "cache_control's 1h ttl: no effect beyond prefix routing",
    "token-efficient-tools-2025-02-19": "the model's tool-call format: nothing to do",
    "token-efficient-tools-2026-03-28": "the model's tool-call format: nothing to do",
    "context-1m-2025-08-07": "the engine's context is its own; a longer prompt is its refusal",
    "output-128k-2025-02-19": "max_tokens is bounded by the engine",
    "effort-2025-11-24": "output_config.effort, as chat's reasoning_effort",
    "structured-outputs-2025-11-13": "output_config.format and strict tools, as chat's",
    "structured-outputs-2025-12-15": "output_config.format and strict tools, as chat's",
    "redact-thinking-2026-02-12": "the engine's reasoning has nothing redacted to send instead: "
    "thinking is sent as the engine streams it",
    "thinking-token-count-2026-05-13": "thinking_tokens where the engine counts them",
    "mid-conversation-system-2026-04-07": "system messages in messages, where they stand",
    "advanced-tool-use-2025-11-20": "the tool fields it adds: decided per field",
    "cache-diagnosis-2026-04-07": "diagnostics: the gateway reports no cache divergence",
    "fast-mode-2026-02-01": "speed: the engine runs as it runs",
    "token-counting-2024-11-01": "count_tokens",
    "model-context-window-exceeded-2025-08-26": "a prompt past the engine's context is its refusal",
}
"""The betas served, and what each comes to here (docs/gateway/messages.md has the table)."""
MAX_BETAS = 64


def check_headers(headers: CIMultiDictProxy[str]) -> None:
    """Refuse a version or a beta the gateway does not serve, by name."""
    versions = headers.getall("anthropic-version", [])
    if len(versions) > 1:
        raise invalid("anthropic-version was given more than once")
    if versions and versions[0].strip() not in VERSIONS:
        served = " and ".join(VERSIONS)
        raise invalid(f"anthropic-version {versions[0][:32]!r} is not served (only {served})")
    betas = [b.strip() for v in headers.getall("anthropic-beta", []) for b in v.split(",")]
    if len(betas) > MAX_BETAS:
        raise invalid(f"anthropic-beta names more than {MAX_BETAS} betas")
    for beta in betas:
        if beta and beta not in BETAS:
            raise RefusedError(
                f"anthropic-beta {beta[:64]!r} is not served by this gateway (the betas it "
                "serves: docs/gateway/messages.md)",
                code="unsupported_parameter",
            )
