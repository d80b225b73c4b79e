"""Warm wake, the policy: what an engine had cached is saved before it stops (a park that is a
stop, a switch, an idle stop, an operator's stop) and given back to its next start, so that
the first request sharing a saved prefix is a cache hit. Plain data and pure decisions: no
I/O, no clock. The room that acts on them is the runner's (``_local/warm.py``).

- `WarmKey`: what makes a saved cache valid. The model file's identity (its size and a hash of
  its header and of samples through it), the engine's own build, its context per slot and its
  slot count, a hash of the launch flags that may change what the cache holds (everything but
  the flags that cannot: threads, logging, the alias, the key, ...), and the ``cache_salt`` the
  prefixes were sent with. A cache is restored only under an equal key (`refusal` names the
  first part that differs): llama.cpp itself checks only the shape of what it reads back (its
  layer count, cache types and size), so without the key it takes a cache another model wrote.
- `SavedSlot`, `Saved`: one saved slot, and an instance's record of its saved slots under one
  key (the manifest, one encode and one decode).
- `to_restore`: what of a record goes back into an engine under a key, hottest first.
- `within_budget`: which saved slots a deployment keeps under its disk budget, the coldest
  dropped first.
- `WarmShown`, `WarmCounts`: what ``status`` and the metrics show of an instance's warm cache.

Never imports the HTTP surface, the relay, the lifecycle or the runner rooms.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "MANIFEST_VERSION",
    "WHYS",
    "Round",
    "Saved",
    "SavedSlot",
    "WarmCounts",
    "WarmKey",
    "WarmShown",
    "to_restore",
    "within_budget",
]

MANIFEST_VERSION = 1

_PARTS = (
    ("engine", "another engine"),
    ("build", "another engine build"),
    ("model", "another model"),
    ("context", "another context size"),
    ("slots", "another slot count"),
    ("flags", "other engine flags"),
    ("salt", "another cache_salt"),
)
"""Each part of a key, in the order a refusal names the first that differs."""


@dataclass(frozen=True, slots=True)
class WarmKey:
    """What a saved cache is valid under (see the module's text)."""

    engine: str
    build: str
    """The engine's own build, as it reports it (llama.cpp's ``build_info``)."""
    model: str
    """The model file's size and hash (``<bytes>:<sha256 hex>``)."""
    context: int
    """Tokens of context per slot."""
    slots: int
    flags: str
    """A hash of the launch flags that may change what the cache holds."""
    salt: str | None = None
    """The ``cache_salt`` its prefixes were sent with: None where the engine's requests carry
    none (llama.cpp's never do: the gateway refuses ``cache_salt`` for it)."""

    def refusal(self, current: WarmKey) -> str | None:
        """Why a cache saved under this key may not go into an engine under ``current``
        (``saved under another model``); None where every part matches."""
        for name, words in _PARTS:
            if getattr(self, name) != getattr(current, name):
                return f"saved under {words}"
        return None


@dataclass(frozen=True, slots=True)
class SavedSlot:
    """One slot's cache as saved: the file it is in, its tokens and bytes, and its heat (its
    rank among the instance's slots when it was saved: 0 is the most recently used)."""

    slot: int
    file: str
    tokens: int
    bytes: int
    rank: int
    saved_at: float
    """When it was saved (wall clock)."""


@dataclass(frozen=True, slots=True)
class Saved:
    """An instance's saved slots, all under one key (its manifest)."""

    key: WarmKey
    slots: tuple[SavedSlot, ...] = ()

    @property
    def size(self) -> int:
        """The bytes its slot files hold."""
        return sum(s.bytes for s in self.slots)

    def with_slot(self, saved: SavedSlot) -> Saved:
        """This record with ``saved`` in place of what it had for that slot."""
        kept = tuple(s for s in self.slots if s.slot != saved.slot)
        return Saved(self.key, (*kept, saved))

    def without(self, slots: Iterable[int]) -> Saved:
        gone = set(slots)
        return Saved(self.key, tuple(s for s in self.slots if s.slot not in gone))

    def encode(self) -> bytes:
        doc = {
            "version": MANIFEST_VERSION,
            "key": asdict(self.key),
            "slots": [asdict(s) for s in sorted(self.slots, key=lambda s: s.slot)],
        }
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Saved:
        """Raises ValueError for anything but a manifest of this version."""
        try:
            doc = json.loads(raw)
            if doc["version"] != MANIFEST_VERSION:
                raise ValueError(f"manifest version {doc['version']!r}")
            key = WarmKey(**doc["key"])
            rows = list(doc["slots"])
            for row in rows:
                file = row["file"]
                if not isinstance(file, str) or not file.endswith(".bin") or "/" in file:
                    raise ValueError(f"not a slot file: {file!r}")
            slots = tuple(SavedSlot(**row) for row in rows)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a manifest: {exc}") from None
        return cls(key, slots)


def to_restore(saved: Saved | None, key: WarmKey, slots: int) -> tuple[list[SavedSlot], str | None]:
    """What of ``saved`` goes back into an engine under ``key`` with ``slots`` slots: its saved
    slots hottest first (only slots the engine has), or none and why (nothing saved; saved
    under another model, context size, salt, ...)."""
    if saved is None or not saved.slots:
        return [], "nothing saved"
    refusal = saved.key.refusal(key)
    if refusal is not None:
        return [], refusal
    return sorted((s for s in saved.slots if 0 <= s.slot < slots), key=lambda s: s.rank), None


def within_budget(
    saved: Saved, budget: int, others: int, keep: Sequence[int] = ()
) -> tuple[Saved, list[SavedSlot]]:
    """``saved`` cut to what fits ``budget`` beside ``others`` (the bytes the deployment's other
    instances hold): the coldest slots dropped first, those in ``keep`` (saved just now, hotter
    than what is left of an earlier save) last. Returns what is kept and what is dropped."""
    fresh = set(keep)
    order = sorted(saved.slots, key=lambda s: (s.slot in fresh, -s.rank))  # coldest first
    total = others + saved.size
    dropped = []
    for s in order:
        if total <= budget:
            break
        dropped.append(s)
        total -= s.bytes
    return saved.without(s.slot for s in dropped), dropped


@dataclass(frozen=True, slots=True)
class Round:
    """One save or restore round of an instance: what it moved and how long it took."""

    prefixes: int
    tokens: int
    bytes: int
    duration_s: float
    at: float
    """When it ended (wall clock)."""
    failed: str | None = None
    """Why some or all of it did not happen (the engine refused, a bound was reached, a key
    differed); None where all of it did."""

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prefixes": self.prefixes,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "duration_s": round(self.duration_s, 3),
            "at": round(self.at, 3),
        }
        if self.failed is not None:
            out["failed"] = self.failed
        return out


WHYS = ("refused", "timeout", "failed", "mismatch", "invalid", "over_budget")
"""Why a save or restore did not happen, as the metrics count it: the engine refused it, its
bound was reached, it failed otherwise, the key differed (restore), a file or manifest failed
the gateway's check, or a slot did not fit the disk budget (save)."""


@dataclass(frozen=True, slots=True)
class WarmCounts:
    """What an instance's warm cache has done since the gateway started."""

    saves: int = 0
    """Slots saved."""
    restores: int = 0
    """Slots restored."""
    saved_bytes: int = 0
    restored_bytes: int = 0
    failures: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """(``save`` or ``restore``, one of `WHYS`) -> how many times."""


@dataclass(frozen=True, slots=True)
class WarmShown:
    """An instance's warm cache as ``status`` and the metrics show it."""

    on: bool
    why_off: str | None = None
    """Why it is off for this instance (``lifecycle.warm_cache: off``, no state directory)."""
    budget: int = 0
    disk_bytes: int = 0
    """What the instance's saved slots hold on disk now."""
    saved: Round | None = None
    restored: Round | None = None
    counts: WarmCounts = WarmCounts()

    def line(self) -> str:
        """What ``status`` prints under the instance."""
        if not self.on:
            return f"warm cache: off ({self.why_off})"
        parts = [f"{_mib(self.disk_bytes)} of {_mib(self.budget)} on disk"]
        for verb, r in (("restored", self.restored), ("saved", self.saved)):
            if r is not None:
                n = f"{r.prefixes} prefix" if r.prefixes == 1 else f"{r.prefixes} prefixes"
                done = f"{verb} {n} ({r.tokens} tokens, {_mib(r.bytes)}) in {r.duration_s:.3f} s"
                parts.append(done + (f", then: {r.failed}" if r.failed else ""))
        return "warm cache: " + "; last ".join(parts)

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {"on": self.on}
        if self.why_off is not None:
            out["off"] = self.why_off
        if self.on:
            out["disk_bytes"], out["disk_budget"] = self.disk_bytes, self.budget
        if self.saved is not None:
            out["last_save"] = self.saved.row()
        if self.restored is not None:
            out["last_restore"] = self.restored.row()
        return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
