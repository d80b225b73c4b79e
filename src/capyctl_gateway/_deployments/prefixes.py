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

__all__ = ["ENTRY_BYTES", "PrefixIndex"]

ENTRY_BYTES = 200
"""What one entry holds in memory at most (its fingerprint, its instances, its order)."""


class PrefixIndex:
    """At most ``max_entries`` fingerprints, each with the instances (a bit mask of their
    indexes) that recently served a prefix ending with it."""

    __slots__ = ("_entries", "max_entries")

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[int, int] = OrderedDict()

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
        entries = self._entries
        bit = 1 << instance
        for fp in reversed(chain):
            entries[fp] = entries.get(fp, 0) | bit
            entries.move_to_end(fp)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def forget(self, instance: int) -> None:
        """``instance``'s cache is gone: nothing it held matches any more."""
        keep = ~(1 << instance)
        entries = self._entries
        for fp, mask in list(entries.items()):
            if mask & keep:
                entries[fp] = mask & keep
            else:
                del entries[fp]

    def held(self, instance: int) -> int:
        """How many fingerprints ``instance`` holds (what ``status`` shows)."""
        bit = 1 << instance
        return sum(1 for mask in self._entries.values() if mask & bit)


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
