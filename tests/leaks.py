"""A pytest plugin (``-p tests.leaks``): a full garbage collection after each test module.

A stream or socket a test left open is only reported when the collector finds it, and a full
collection comes when allocations happen to trigger one: the warning (an error here) then
lands on whichever test runs at that moment, often minutes and modules later. Collecting at
the end of each module lays it on the module that leaked it, every run, for about 30 ms a
module."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module", autouse=True)
def _collect_what_the_module_left() -> Iterator[None]:
    yield
    gc.collect()
