"""``POST /v1/messages/count_tokens``: the prompt the request would be, counted by the
engine's own tokenizer, never estimated.

The request becomes the chat messages and tools a Messages request would send (``request.py``),
and the engine renders them with its chat template and tokenizes the result, as its chat
endpoint would:

- vLLM: ``POST /tokenize`` with the messages and tools (its chat form, the generation prompt
  added): its ``count``;
- llama.cpp: ``POST /apply-template`` with the chat request (the prompt as its chat endpoint
  renders it), then ``POST /tokenize`` of that prompt with its special tokens
  (``add_special``, as its chat endpoint tokenizes it): the tokens' number.

SGLang and TensorFold are refused (`COUNTED` has neither: the gateway relies on no tokenizer
endpoint of theirs), and so is a deployment on other machines, whose hosts' ingress forwards
chat and decisions only.
"""

from __future__ import annotations

from typing import Any

import orjson

from .._config import Deployment
from .._engines import EngineKind
from .._errors import EngineError, RefusedError
from .._relay.exchange import Answer, Exchange
from .._relay.refusal import forwarded, refusal
from .request import check_count

__all__ = ["COUNTED", "check_tokens", "count_tokens"]

COUNTED = (EngineKind.VLLM, EngineKind.LLAMACPP)


def check_tokens(body: dict[str, Any], dep: Deployment) -> dict[str, Any]:
    """The count_tokens checks of ``body`` for ``dep``: the chat request whose prompt is
    counted."""
    if dep.engine not in COUNTED:
        raise RefusedError(
            f"count_tokens is not served for {dep.engine.value}: the gateway counts with the "
            "engine's own tokenizer, and relies on none of this engine's",
            code="unsupported_parameter",
        )
    if dep.remote:
        raise RefusedError(
            f"count_tokens is not served for deployment {dep.name}: it runs on another "
            "machine, whose ingress forwards chat and decisions only",
            code="unsupported_parameter",
        )
    return check_count(body, dep)


async def count_tokens(ex: Exchange, dep: Deployment, payload: bytes, *, cap: int) -> bytes:
    """The count's answer, ``{"input_tokens": N}``, for the checked chat request ``payload``
    (as the engine would get it: its model written, a stream asked for, which no tokenizer
    takes and so is dropped here)."""
    chat = orjson.loads(payload)
    for key in ("stream", "stream_options"):
        chat.pop(key, None)
    async with ex:
        if dep.engine is EngineKind.VLLM:
            ask = {k: chat[k] for k in ("model", "messages", "tools") if k in chat}
            answer = await _ask(ex, "/tokenize", {**ask, "add_generation_prompt": True}, cap)
            count = answer.get("count")
        else:
            prompt = (await _ask(ex, "/apply-template", chat, cap)).get("prompt")
            if not isinstance(prompt, str):
                raise EngineError(f"{ex.where}: the engine's template answer has no prompt")
            _pool(ex)  # read whole: its connection pooled, and the exchange asks again
            tokens = await _ask(ex, "/tokenize", {"content": prompt, "add_special": True}, cap)
            count = tokens.get("tokens")
            count = len(count) if isinstance(count, list) else None
        ex.complete()
    if type(count) is not int or count < 0:
        raise EngineError(f"{ex.where}: the engine's tokenizer answer has no count")
    return orjson.dumps({"input_tokens": count})


async def _ask(ex: Exchange, path: str, body: dict[str, Any], cap: int) -> dict[str, Any]:
    """POST ``body`` to ``path`` on the exchange's engine; its JSON object answer, read whole
    (at most ``cap`` bytes)."""
    resp: Answer = await ex.post(orjson.dumps(body), path)
    if resp.status != 200:
        forwarded(ex, resp)
    raw = await resp.content.read(cap + 1)
    if resp.status != 200:
        ex.outcome.completed = True
        raise await refusal(resp, ex.where, raw)
    if len(raw) > cap:
        raise EngineError(f"{ex.where}: the engine's answer is over {cap} bytes")
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict):
        raise EngineError(f"{ex.where}: the engine's tokenizer answer is not a JSON object")
    return answer


def _pool(ex: Exchange) -> None:
    """Pool the connection of the exchange's answer, read whole, so that it may post again
    (its exit then ends the next answer's connection, not this one's)."""
    resp, ex.response = ex.response, None
    if resp is not None:
        resp.release()
