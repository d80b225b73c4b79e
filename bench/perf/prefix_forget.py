"""What the prefix index's ``forget`` and a body's fingerprints cost on the event loop, at their
edges (issue 42, item 14).

* ``forget``: an index full at the default size (16,384 entries) and at the largest allowed
  (1,048,576), its entries spread over 8 instances; the time to forget one instance that holds
  an eighth of it, and one that holds one chain (a cache restarted before much traffic).
* fingerprints: a 60 MiB prompt written as one string, and the same written as content parts
  (``[{"type": "text", "text": ...}]``).

Each figure is the best of three runs. In-process, one core:
``.venv/bin/python -m bench.perf.prefix_forget``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from capyctl_gateway._deployments.prefixes import PrefixIndex
from capyctl_gateway._routing.prefix import MAX_BLOCKS, fingerprints

INSTANCES = 8


def _full(entries: int) -> PrefixIndex:
    index = PrefixIndex(entries)
    fp = 0
    for n in range(entries // MAX_BLOCKS):
        index.note(range(fp, fp + MAX_BLOCKS), n % INSTANCES)
        fp += MAX_BLOCKS
    index.note(range(fp, fp + MAX_BLOCKS), INSTANCES)  # one chain on one more instance
    return index


def _best_ms(make: Callable[[], PrefixIndex], instance: int) -> float:
    best = float("inf")
    for _ in range(3):
        index = make()
        start = time.perf_counter()
        index.forget(instance)
        best = min(best, time.perf_counter() - start)
    return best * 1000


def _best_fp_ms(body: dict[str, Any]) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fingerprints(body, chat=True, salt=None, seed=1)
        best = min(best, time.perf_counter() - start)
    return best * 1000


def main() -> None:
    for entries in (16_384, 1_048_576):
        make = functools.partial(_full, entries)
        print(f"index of {len(make()):,} entries over {INSTANCES} instances:")
        print(f"  forget one holding an eighth: {_best_ms(make, 0):.3f} ms")
        print(f"  forget one holding one chain: {_best_ms(make, INSTANCES):.3f} ms")
    text = "y" * (60 * 1024 * 1024)
    plain: dict[str, Any] = {"messages": [{"role": "user", "content": text}]}
    parts: dict[str, Any] = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]
    }
    print(f"fingerprints of 60 MiB as a string: {_best_fp_ms(plain):.3f} ms")
    print(f"fingerprints of 60 MiB as parts:    {_best_fp_ms(parts):.3f} ms")


if __name__ == "__main__":
    main()
