"""Prefix routing's two pure parts: the fingerprints of a request's prompt (two requests share a
leading run exactly as long as the full blocks of prompt they share; salts never meet) and the
bounded index of which instance served which prefix, held against a plain model."""

from __future__ import annotations

import tracemalloc
from collections.abc import Sequence
from typing import Any

import orjson
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from capyctl_gateway._deployments.prefixes import ENTRY_BYTES, HOLDER_BYTES, PrefixIndex
from capyctl_gateway._routing.prefix import (
    BLOCK_BYTES,
    MAX_BLOCKS,
    WINDOW_BYTES,
    _cut,
    fingerprints,
    pack,
    unpack,
)

SEED = 0x5EED


def reference_text(body: dict[str, Any]) -> bytes:
    """The canonical prompt as the docstring defines it, written whole and cut afterwards."""
    parts: list[Any] = [{"tools": body["tools"]}] if "tools" in body else []
    parts += body["messages"]
    whole = b"".join(orjson.dumps(p, option=orjson.OPT_SORT_KEYS) + b"\n" for p in parts)
    return whole[:WINDOW_BYTES]


def fingerprints_of(text: bytes) -> tuple[int, ...]:
    """The chain of an unsalted canonical prompt ``text``, as the module's docstring defines it."""
    h, chain = xxhash.xxh3_64_intdigest(b"\x00", SEED), []
    for start in range(0, len(text) - BLOCK_BYTES + 1, BLOCK_BYTES):
        h = xxhash.xxh3_64_intdigest(text[start : start + BLOCK_BYTES], h)
        chain.append(h)
    return tuple(chain)


def common(a: Sequence[object], b: Sequence[object]) -> int:
    """How long a run ``a`` and ``b`` begin with (bytes or fingerprints alike)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=3000) | st.sampled_from(
    ["", "x" * 70_000, "é" * 40_000, 'q"\\' * 500]
)
parts = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts})
    | st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": texts})}
    ),
    max_size=4,
)
"""Content written as parts, as OpenAI's schema allows (text, and an image's data URL)."""
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": texts | parts},
    optional={"name": st.text(max_size=8)},
)
messages = st.lists(message, min_size=1, max_size=6)


def chat(msgs: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    return {"model": "m", "messages": msgs, **more}


@settings(max_examples=150, deadline=None)
@given(shared=messages, a=messages, b=messages)
def test_two_prompts_share_a_run_of_fingerprints_as_long_as_their_shared_full_blocks(
    shared: list[dict[str, Any]], a: list[dict[str, Any]], b: list[dict[str, Any]]
) -> None:
    one, two = chat(shared + a), chat(shared + b)
    fa = fingerprints(one, chat=True, salt=None, seed=SEED)
    fb = fingerprints(two, chat=True, salt=None, seed=SEED)
    ta, tb = reference_text(one), reference_text(two)
    assert len(fa) == len(ta) // BLOCK_BYTES <= MAX_BLOCKS
    assert len(fb) == len(tb) // BLOCK_BYTES
    expected = min(common(ta, tb) // BLOCK_BYTES, len(fa), len(fb))
    assert common(fa, fb) == expected
    # a small body is written whole, a large one (or one of unknown size) cut: the same chain
    assert fingerprints(one, chat=True, salt=None, seed=SEED, sent=1000) == fa


@settings(max_examples=50, deadline=None)
@given(msgs=messages, s1=st.text(min_size=1, max_size=20), s2=st.text(min_size=1, max_size=20))
def test_one_salts_prefix_never_matches_anothers(
    msgs: list[dict[str, Any]], s1: str, s2: str
) -> None:
    body = chat(msgs)
    salted = fingerprints(body, chat=True, salt=s1, seed=SEED)
    unsalted = fingerprints(body, chat=True, salt=None, seed=SEED)
    assert not set(salted) & set(unsalted)
    if s1 != s2:
        assert not set(salted) & set(fingerprints(body, chat=True, salt=s2, seed=SEED))
    else:
        assert salted == fingerprints(body, chat=True, salt=s2, seed=SEED)


def test_the_seed_tools_and_a_decisions_state_are_part_of_the_prefix() -> None:
    body = chat([{"role": "system", "content": "You answer briefly. " * 100}])
    plain = fingerprints(body, chat=True, salt=None, seed=SEED)
    assert len(plain) == len(reference_text(body)) // BLOCK_BYTES > 0
    assert not set(plain) & set(fingerprints(body, chat=True, salt=None, seed=SEED + 1))
    tools = {**body, "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert fingerprints(tools, chat=True, salt=None, seed=SEED)[0] != plain[0]
    decision = {"model": "d", "state": "The customer writes: " + "x" * 600, "questions": {}}
    other = {**decision, "questions": {"q": {"type": "noul", "instructions": "?"}}}
    assert fingerprints(decision, chat=False, salt=None, seed=SEED) == fingerprints(
        other, chat=False, salt=None, seed=SEED
    )  # the questions come after the input: the prefix is the state's
    assert len(fingerprints(decision, chat=False, salt=None, seed=SEED)) == 2


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(value=json_values, left=st.integers(min_value=0, max_value=400))
def test_a_cut_value_writes_the_same_first_bytes(value: Any, left: int) -> None:
    """What `_cut` keeps of a value writes as the value does for the first ``left`` bytes, and
    its length bound holds."""
    whole = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    kept, at_least = _cut(value, left)
    cut = orjson.dumps(kept, option=orjson.OPT_SORT_KEYS)
    assert cut[:left] == whole[:left]
    assert at_least <= len(cut) or at_least >= left


@pytest.mark.parametrize("how", ["string", "parts", "image"])
def test_a_prompt_past_the_window_costs_no_more_than_the_window(how: str) -> None:
    """Issue 42, item 14: content written as parts was written whole (8 MB of text, 74 MB
    at the peak) to fingerprint its first 64 KiB; a plain string was cut first."""
    text = "y" * 8_000_000
    content: Any = {
        "string": text,
        "parts": [{"type": "text", "text": "a"}, {"type": "text", "text": text}],
        "image": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + text}}],
    }[how]
    huge = chat([{"role": "user", "content": content}, {"role": "user", "content": text}])
    tracemalloc.start()
    try:
        chain = fingerprints(huge, chat=True, salt=None, seed=SEED)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # What is written is the window, not the body (orjson reserves some 16 bytes a character
    # of a string it writes: a 64 KiB window peaks at about 1 MiB, 8 MB of text at 74 MB).
    assert peak < 64 * WINDOW_BYTES, peak
    assert len(chain) == MAX_BLOCKS
    assert chain == fingerprints_of(reference_text(huge))
    assert unpack(pack(chain)) == chain


@given(st.binary(max_size=64))
def test_a_broken_chain_on_the_line_is_refused(raw: bytes) -> None:
    import base64

    text = base64.b64encode(raw).decode()
    if len(raw) % 8:
        try:
            unpack(text)
        except ValueError:
            return
        raise AssertionError("a chain that is not whole words was taken")
    assert pack(unpack(text)) == text


# --- the index against a plain model ------------------------------------------------------------


class PlainIndex:
    """What `PrefixIndex` promises, written the slow way: each fingerprint's holders and the
    tick it was last touched; the oldest touched goes first past the cap."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.holders: dict[int, set[int]] = {}
        self.touched: dict[int, int] = {}
        self.tick = 0
        self.firsts: set[int] = set()
        """Fingerprints that began a noted chain."""

    def note(self, chain: list[int], instance: int) -> None:
        self.firsts.update(chain[:1])
        for fp in reversed(chain):  # the first block touched last: it outlives the tail
            self.holders.setdefault(fp, set()).add(instance)
            self.tick += 1
            self.touched[fp] = self.tick
        while len(self.holders) > self.cap:
            oldest = min(self.touched, key=self.touched.__getitem__)
            del self.holders[oldest], self.touched[oldest]
            self.firsts.discard(oldest)

    def forget(self, instance: int) -> None:
        for fp in list(self.holders):
            self.holders[fp].discard(instance)
            if not self.holders[fp]:
                del self.holders[fp], self.touched[fp]
                self.firsts.discard(fp)

    def match(self, chain: list[int]) -> dict[int, int]:
        out = {}
        for instance in {i for h in self.holders.values() for i in h}:
            n = 0
            while n < len(chain) and instance in self.holders.get(chain[n], ()):
                n += 1
            if n:
                out[instance] = n
        return out


FPS = st.integers(min_value=0, max_value=40)  # few values: chains overlap and collide often
CHAINS = st.lists(FPS, min_size=0, max_size=12, unique=True)
INSTANCES = st.integers(min_value=0, max_value=4)


class IndexMachine(RuleBasedStateMachine):
    @initialize(cap=st.integers(min_value=1, max_value=30))
    def make(self, cap: int) -> None:
        self.index = PrefixIndex(cap)
        self.model = PlainIndex(cap)

    @rule(chain=CHAINS, instance=INSTANCES)
    def note(self, chain: list[int], instance: int) -> None:
        self.index.note(chain, instance)
        self.model.note(chain, instance)

    @rule(instance=INSTANCES)
    def forget(self, instance: int) -> None:
        self.index.forget(instance)
        self.model.forget(instance)

    @rule(chain=CHAINS)
    def match(self, chain: list[int]) -> None:
        assert self.index.match(chain) == self.model.match(chain)

    @invariant()
    def bounded_and_equal(self) -> None:
        assert len(self.index) == len(self.model.holders) <= self.index.max_entries
        for instance in range(5):
            held = sum(1 for h in self.model.holders.values() if instance in h)
            assert self.index.held(instance) == held
            starts = sum(
                1
                for fp, h in self.model.holders.items()
                if instance in h and fp in self.model.firsts
            )
            assert self.index.starts(instance) == starts


TestIndexAgainstModel = IndexMachine.TestCase
TestIndexAgainstModel.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


class Watched(int):
    """A fingerprint that counts how often it is hashed: what a look-up or a write of its
    entry in the index costs."""

    hashed = 0

    def __hash__(self) -> int:
        Watched.hashed += 1
        return int.__hash__(self)


def test_forget_touches_only_the_forgotten_instances_entries() -> None:
    """Issue 42, item 14: forget scanned and rewrote the whole index (1.15 s at its largest, on
    the event loop) to drop one instance; it reads only the entries that instance holds."""
    index = PrefixIndex(4096)
    others = [Watched(n) for n in range(1000, 3000)]
    for start in range(0, len(others), 100):
        index.note(others[start : start + 100], 1 + start % 3)
    index.note(list(range(10)), 0)
    index.note([Watched(2500), 7], 0)  # an entry it shares with another: read, and kept
    Watched.hashed = 0
    index.forget(0)
    assert Watched.hashed <= 2  # the one it shares: read, and written back without it
    assert index.held(0) == 0 and index.match(list(range(10))) == {}
    assert index.match(others[:100]) == {1: 100}
    assert index.held(1) + index.held(2) + index.held(3) == len(others)


def test_what_an_instance_was_given_stays_bounded_by_what_it_holds() -> None:
    """Each instance's list of what it was given (what `forget` reads) keeps evicted entries
    only until it is half again what the instance holds, and 64 more."""
    index = PrefixIndex(16)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(5000):
            index.note([n * 8 + k for k in range(8)], n % 2)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.held(0) + index.held(1) == 16
    # what each list may keep past what its instance holds: 64 and a half, 64 bytes at most a
    # fingerprint (its int, its place, the list's slack); not 40,000 fingerprints (1.6 MB)
    assert held < 16 * ENTRY_BYTES + 2 * (64 + 16) * 64, held
    index.forget(0)
    index.forget(1)
    assert len(index) == 0 and index.match([4999 * 8 + 7]) == {}


@pytest.mark.parametrize("holders", [1, 8])
def test_a_full_index_holds_its_cap_in_entries_and_bytes(holders: int) -> None:
    """The bound the configuration documents: ``prefix_entries`` entries of at most
    `ENTRY_BYTES` each, and `HOLDER_BYTES` for each further instance holding one, however many
    chains arrive."""
    cap = 4096
    tracemalloc.start()
    try:
        index = PrefixIndex(cap)
        before = tracemalloc.get_traced_memory()[0]
        for n in range(64):
            chain = [hash((n, k)) & (2**64 - 1) for k in range(MAX_BLOCKS)]
            for k in range(holders):
                index.note(chain, (n + k) % 8)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(index) == cap
    assert held <= cap * (ENTRY_BYTES + (holders - 1) * HOLDER_BYTES), held
