"""A pytest plugin (``-p tests.leaks``): find the socket a test left open, and say who opened it.

A stream or socket a test left open is only reported when the collector finds it, and a full
collection comes when allocations happen to trigger one: the warning (an error here) then
lands on whichever test runs at that moment, often minutes and modules later. Two things
make such a leak say where it came from:

- a full collection at the end of each test module lays it on the module that leaked it,
  every run, for about 30 ms a module;
- every asyncio socket transport remembers what made it (its protocol, its two addresses
  and the stack that created it, without source lines: a few microseconds each), and one
  collected unclosed says all of that in its warning. Python's own warning names only the
  file descriptor, which is another socket's by then."""

from __future__ import annotations

import gc
import traceback
import warnings
from asyncio import selector_events
from collections.abc import Iterator
from typing import Any

import pytest

_Transport: Any = getattr(selector_events, "_SelectorTransport")  # noqa: B009 - private
_made = _Transport.__init__


def _init(self: Any, loop: Any, sock: Any, protocol: Any, *args: Any, **kwargs: Any) -> None:
    _made(self, loop, sock, protocol, *args, **kwargs)
    stack = traceback.StackSummary.extract(traceback.walk_stack(None), limit=24, lookup_lines=False)
    extra = self._extra
    self._capyctl_origin = (
        type(protocol).__qualname__,
        extra.get("sockname"),
        extra.get("peername"),
        stack,
    )


def _del(self: Any) -> None:
    if self._sock is None:
        return
    origin = getattr(self, "_capyctl_origin", None)
    if origin is None:
        said = ""
    else:
        protocol, ours, theirs, stack = origin
        frames = "".join(f"\n    {f.filename}:{f.lineno} in {f.name}" for f in reversed(stack))
        said = f": {protocol}, {ours} to {theirs}, made at (outermost first){frames}"
    warnings.warn(f"unclosed transport {self!r}{said}", ResourceWarning, stacklevel=1)
    self._sock.close()


_Transport.__init__ = _init
_Transport.__del__ = _del


@pytest.fixture(scope="module", autouse=True)
def _collect_what_the_module_left() -> Iterator[None]:
    yield
    gc.collect()
