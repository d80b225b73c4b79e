"""llama.cpp's slot routes, as llama-server b10798 speaks them (read in its
``tools/server/server-context.cpp`` and captured live here):

- ``GET /props``: ``model_path``, ``build_info`` (``b10798-unknown``), ``total_slots`` and
  ``default_generation_settings.n_ctx`` (the context of one slot).
- ``GET /slots``: one object per slot, ``id`` and ``is_processing``; a slot that ran a task
  since the engine started also carries ``id_task`` (the engine's task counter: the higher,
  the more recently used) and ``n_prompt_tokens``.
- ``POST /slots/{id}?action=save`` with ``{"filename": NAME}`` writes the slot's tokens and its
  KV cells to ``<--slot-save-path>/NAME`` (``llama_state_seq_save_file``) and answers
  ``{"id_slot", "filename", "n_saved" (tokens), "n_written" (bytes), "timings": {"save_ms"}}``.
  A name with a path in it is refused (400 ``Invalid filename``); without
  ``--slot-save-path`` the route answers 501. The file is written in place, not renamed into
  place: a save cut short leaves a partial file.
- ``POST /slots/{id}?action=restore`` with the same body reads it back
  (``llama_state_seq_load_file``) and answers ``n_restored`` and ``n_read``; a file it cannot
  take answers 400 ``Unable to restore slot: No available space in KV cache or invalid slot
  save file`` and leaves the slot empty. It checks the file's magic and version, that its
  tokens fit the slot, and the cache's shape (layer count, stream count, the V layout, each
  layer's types and row sizes); never the model's weights nor a flag such as
  ``--rope-freq-base``: a cache another model of the same shape wrote is taken, and served
  (`WarmKey` keeps that from happening).

Both run as one of the engine's tasks: a slot that is processing defers them until it is
idle, and the engine runs one task at a time, so a request that arrives while a restore runs
in the engine is taken after it (never on a half-restored slot). Each call here has a bound;
one that fails raises `WarmCacheError`.

Never imports the HTTP surface, the relay, the lifecycle or the runner rooms.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from .._errors import EngineControlError

__all__ = [
    "EngineProps",
    "Moved",
    "SlotState",
    "WarmCacheError",
    "props",
    "restore",
    "save",
    "slots",
]


class WarmCacheError(EngineControlError):
    """A save or restore of an engine's cache did not happen: ``why`` is ``refused`` (the
    engine said no), ``timeout`` (past its bound) or ``failed`` (anything else). Caught where
    it is raised: it costs the warm cache, never a start or a stop."""

    def __init__(self, message: str, *, why: str) -> None:
        super().__init__(message)
        self.why = why


ANSWER_BYTES = 1 << 20
"""The most of an answer read from these routes (a ``/slots`` of many slots is a few KiB)."""


@dataclass(frozen=True, slots=True)
class EngineProps:
    """What llama-server says of itself that a saved cache must match."""

    model_path: str
    build: str
    context: int
    """Tokens of context per slot."""
    slots: int


@dataclass(frozen=True, slots=True)
class SlotState:
    id: int
    processing: bool
    task: int | None
    """The last task it ran (higher: more recent); None if it ran none since the start."""


@dataclass(frozen=True, slots=True)
class Moved:
    """What a save wrote or a restore read: tokens and bytes."""

    tokens: int
    bytes: int


async def _call(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    headers: dict[str, str],
    timeout_s: float,
    body: dict[str, str] | None = None,
    what: str = "",
) -> Any:
    what = what or url.rsplit("/", 1)[-1]
    if timeout_s <= 0:
        raise WarmCacheError(f"{what}: no time left", why="timeout")
    try:
        async with session.request(
            method, url, headers=headers, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            raw = await resp.content.read(ANSWER_BYTES)
            if resp.status != 200:
                said = raw[:300].decode(errors="replace")
                raise WarmCacheError(f"{what} answered HTTP {resp.status}: {said}", why="refused")
    except TimeoutError:
        raise WarmCacheError(f"{what} took more than {timeout_s:.1f} s", why="timeout") from None
    except aiohttp.ClientError as exc:
        raise WarmCacheError(f"{what} failed: {exc}", why="failed") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise WarmCacheError(f"{what} answered no JSON", why="failed") from None


def _int(doc: Any, *path: str) -> int:
    for key in path:
        doc = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(doc, int) or isinstance(doc, bool) or doc < 0:
        raise WarmCacheError(f"the engine's answer has no {'.'.join(path)}", why="failed")
    return doc


async def props(
    session: aiohttp.ClientSession, base: str, headers: dict[str, str], timeout_s: float
) -> EngineProps:
    doc = await _call(session, "GET", f"{base}/props", headers, timeout_s)
    path, build = doc.get("model_path"), doc.get("build_info")
    if not isinstance(path, str) or not path or not isinstance(build, str):
        raise WarmCacheError("/props names no model_path or build_info", why="failed")
    context = _int(doc, "default_generation_settings", "n_ctx")
    return EngineProps(path, build, context, _int(doc, "total_slots"))


async def slots(
    session: aiohttp.ClientSession, base: str, headers: dict[str, str], timeout_s: float
) -> list[SlotState]:
    doc = await _call(session, "GET", f"{base}/slots", headers, timeout_s)
    if not isinstance(doc, list):
        raise WarmCacheError("/slots is not a list", why="failed")
    out = []
    for s in doc:
        task = s.get("id_task") if isinstance(s, dict) else None
        out.append(
            SlotState(
                _int(s, "id"),
                bool(s.get("is_processing")),
                task if isinstance(task, int) and not isinstance(task, bool) else None,
            )
        )
    return out


async def _action(
    session: aiohttp.ClientSession,
    base: str,
    headers: dict[str, str],
    slot: int,
    action: str,
    filename: str,
    timeout_s: float,
) -> Moved:
    url = f"{base}/slots/{slot}?action={action}"
    what = f"the {action} of slot {slot}"
    doc = await _call(session, "POST", url, headers, timeout_s, {"filename": filename}, what)
    tokens, nbytes = ("n_saved", "n_written") if action == "save" else ("n_restored", "n_read")
    return Moved(_int(doc, tokens), _int(doc, nbytes))


async def save(
    session: aiohttp.ClientSession,
    base: str,
    headers: dict[str, str],
    slot: int,
    filename: str,
    timeout_s: float,
) -> Moved:
    """Have the engine write slot ``slot`` to ``filename`` in its slot save directory."""
    return await _action(session, base, headers, slot, "save", filename, timeout_s)


async def restore(
    session: aiohttp.ClientSession,
    base: str,
    headers: dict[str, str],
    slot: int,
    filename: str,
    timeout_s: float,
) -> Moved:
    """Have the engine read slot ``slot`` back from ``filename``."""
    return await _action(session, base, headers, slot, "restore", filename, timeout_s)
