"""The wake check: after an engine kept its process through a park (vLLM's sleep, SGLang's
memory release), it answers a short fixed prompt before it serves again, and the answer must be
the one it gave when it first became ready. Weights brought back wrong (a bad offload, memory
corrupted while asleep) show as a different answer; the engine is then stopped with
``wake_mismatch`` rather than let it serve wrong answers.

The prompt asks for a few tokens with greedy decoding and a fixed seed, so a sound engine gives
the same answer every time. A llama.cpp router's wake is a fresh load from the model file, not
a restore: it is not checked. Never imports the HTTP surface, the relay or the gateway's state.
"""

from __future__ import annotations

import logging

import aiohttp
import orjson

from .._config import Deployment
from .._errors import StartFailedError
from .routes import EngineInstance

__all__ = ["CHECK_TIMEOUT_S", "answer", "auth_of", "check", "compare", "record"]

logger = logging.getLogger("capyctl_gateway")

CHECK_TIMEOUT_S = 60.0
PROMPT = "Repeat after me, word for word: the quick brown fox jumps over the lazy dog."
MAX_TOKENS = 12


async def answer(
    session: aiohttp.ClientSession, url: str, model: str, headers: dict[str, str]
) -> str:
    """The engine's answer to the check's prompt. Raises StartFailedError if there is none."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "seed": 0,
        "stream": True,  # as the gateway asks every engine; the deltas are joined
    }
    try:
        async with session.post(
            f"{url}/v1/chat/completions",
            data=orjson.dumps(body),
            headers={**headers, "Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=CHECK_TIMEOUT_S),
        ) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise StartFailedError(f"wake check: the engine answered HTTP {resp.status}")
        return _joined(raw)
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, LookupError) as exc:
        raise StartFailedError(f"wake check: no answer from the engine ({exc})") from None


def compare(recorded: str, now: str) -> None:
    """Raise StartFailedError (``wake_mismatch``) when the answer after a wake is not the one
    recorded at the first start."""
    if now != recorded:
        raise StartFailedError(
            "wake_mismatch: after waking, the engine answered the check's fixed prompt "
            f"differently ({len(now)} characters, not the {len(recorded)} recorded when it "
            "first became ready); stopped rather than serve wrong answers"
        )


def _joined(raw: bytes) -> str:
    """The text of a streamed answer: its content deltas, joined."""
    parts: list[str] = []
    for line in raw.splitlines():
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        choices = orjson.loads(line[5:])["choices"]
        if choices:
            parts.append(str(choices[0].get("delta", {}).get("content") or ""))
    return "".join(parts)


def auth_of(inst: EngineInstance) -> dict[str, str]:
    """The engine's key as a header (none when it has none)."""
    key = inst.engine_key
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


async def record(session: aiohttp.ClientSession, inst: EngineInstance, d: Deployment) -> str | None:
    """The answer a just-started engine gives (None, logged, when it gives none: it serves,
    but its wakes go unchecked)."""
    if inst.url is None:
        return None
    try:
        return await answer(session, inst.url, d.engine_model, auth_of(inst))
    except StartFailedError as exc:
        logger.warning("%s: no answer to record for its wake checks (%s)", inst.where, exc)
        return None


async def check(
    session: aiohttp.ClientSession, inst: EngineInstance, d: Deployment, recorded: str
) -> None:
    """Ask a woken engine again; raise StartFailedError unless it answers as recorded."""
    if inst.url is None:
        raise StartFailedError("wake check: the engine has no address")
    compare(recorded, await answer(session, inst.url, d.engine_model, auth_of(inst)))
