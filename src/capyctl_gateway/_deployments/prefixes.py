"""Which instance of a deployment recently served which prompt prefixes: the index that prefix
routing reads (`PrefixIndex`).

An entry is one prefix fingerprint (``_routing/prefix.py``) and the instances that were sent a
request whose chain holds it. Entries are kept least recently used first and capped; the first
blocks of a chain are touched last, so a shared system prompt outlives the tails of the
conversations that began with it. An instance whose cache is gone (stopped, restarted, parked,
woken with a fresh cache) is forgotten at once. Plain data: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["ENTRY_BYTES", "HOLDER_BYTES", "PrefixIndex"]

ENTRY_BYTES = 200
"""What one entry held by one instance holds in memory at most (its fingerprint, its instances,
its order, its place in that instance's list)."""
HOLDER_BYTES = 24
"""What each further instance holding an entry adds (its place in that instance's list)."""


class PrefixIndex:
    """At most ``max_entries`` fingerprints, each with the instances (a bit mask of their
    indexes) that recently served a prefix ending with it.

    Each instance also keeps the fingerprints it was given (`forget` reads those, never the
    whole index: a scan of the largest index held the event loop for a second). That list may
    hold entries since evicted, or given again after an eviction; it is rebuilt once it is
    half again what the instance holds (and 64 more), so it stays within a small multiple of
    it.
    """

    __slots__ = ("_entries", "_given", "_held", "_rooted", "_roots", "max_entries")

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[int, int] = OrderedDict()
        self._roots: set[int] = set()
        """The entries that are a chain's first block: one per distinct prompt start."""
        self._rooted: dict[int, int] = {}
        """Of those, how many each instance holds."""
        self._given: dict[int, list[int]] = {}
        """Each instance's fingerprints, as it was given them (see the class's text)."""
        self._held: dict[int, int] = {}
        """How many entries each instance holds."""

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, chain: Sequence[int]) -> dict[int, int]:
        """How many leading blocks of ``chain`` each instance holds (only those holding one)."""
        entries = self._entries
        matched: dict[int, int] = {}
        alive = entries.get(chain[0], 0) if chain else 0
        depth = 1
        while alive and depth < len(chain):
            holds = entries.get(chain[depth], 0)
            for index in _bits(alive & ~holds):
                matched[index] = depth
            alive &= holds
            depth += 1
        for index in _bits(alive):
            matched[index] = depth
        return matched

    def note(self, chain: Sequence[int], instance: int) -> None:
        """``instance`` was sent a request whose prefix is ``chain``."""
        if not chain:
            return
        entries, rooted, roots = self._entries, self._rooted, self._roots
        bit = 1 << instance
        if chain[0] not in roots:  # a prompt start from now on, for all who hold it
            roots.add(chain[0])
            for index in _bits(entries.get(chain[0], 0)):
                rooted[index] = rooted.get(index, 0) + 1
        given = self._given.setdefault(instance, [])
        new = len(given)
        for fp in reversed(chain):
            mask = entries.get(fp, 0)
            if not mask & bit:
                given.append(fp)
                if fp in roots:
                    rooted[instance] = rooted.get(instance, 0) + 1
            entries[fp] = mask | bit
            entries.move_to_end(fp)
        self._held[instance] = self._held.get(instance, 0) + len(given) - new
        while len(entries) > self.max_entries:
            fp, mask = entries.popitem(last=False)
            if fp in roots:
                roots.discard(fp)
                for index in _bits(mask):
                    rooted[index] -= 1
            for index in _bits(mask):
                self._held[index] -= 1
                self._tidy(index)
        self._tidy(instance)

    def forget(self, instance: int) -> None:
        """``instance``'s cache is gone: nothing it held matches any more."""
        bit = 1 << instance
        entries = self._entries
        for fp in self._given.pop(instance, ()):
            mask = entries.get(fp, 0)
            if not mask & bit:
                continue  # evicted since, or given twice
            if mask & ~bit:
                entries[fp] = mask & ~bit
            else:
                del entries[fp]
                self._roots.discard(fp)
        self._held.pop(instance, None)
        self._rooted.pop(instance, None)

    def _tidy(self, instance: int) -> None:
        """Rebuild ``instance``'s list of fingerprints once it is past half again what it
        holds."""
        given = self._given.get(instance)
        if given is not None and len(given) > self._held[instance] * 3 // 2 + 64:
            bit, entries = 1 << instance, self._entries
            kept = [fp for fp in dict.fromkeys(given) if entries.get(fp, 0) & bit]
            self._given[instance] = kept

    def held(self, instance: int) -> int:
        """How many fingerprints ``instance`` holds."""
        return self._held.get(instance, 0)

    def starts(self, instance: int) -> int:
        """How many distinct prompt starts (chains' first blocks) ``instance`` holds: roughly,
        how many tenants' prompts its cache is shared among."""
        return self._rooted.get(instance, 0)


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
