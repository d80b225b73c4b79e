"""What a worker says to its authority (``messages.py`` has the whole protocol): each message a
frozen dataclass with one `encode` and one `decode`, as there.

`Ready`, `Admit`, `Next`, `End`, `Gone`, `Counts`, `Answered` (the engine's first output for
a request, so that the authority knows it was answered even if the worker dies before its
`End`), and `Pong`, the answer to a ping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .._routing.prefix import pack, unpack
from .._tally import Figures

__all__ = ["Admit", "Answered", "Counts", "End", "Gone", "Next", "Pong", "Ready"]


# --- worker -> authority -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ready:
    """The worker listens."""

    TAG: ClassVar[str] = "R"

    def encode(self) -> list[Any]:
        return [self.TAG]

    @classmethod
    def decode(cls, m: list[Any]) -> Ready:
        (_,) = m
        return cls()


@dataclass(frozen=True, slots=True)
class Admit:
    """Place request ``gid`` (its deployment, API, IDs and routing facts: its salt, its
    prefix fingerprints and its priority, never its body; ``left``: seconds before its deadline
    when it was sent)."""

    TAG: ClassVar[str] = "A"
    gid: int
    deployment: str
    api: str
    rid: str
    caller: str | None
    left: float
    salt: str | None
    prefix: tuple[int, ...]
    priority: int = 0

    def encode(self) -> list[Any]:
        s = self
        chain = pack(s.prefix)
        return [
            s.TAG,
            s.gid,
            s.deployment,
            s.api,
            s.rid,
            s.caller,
            s.left,
            s.salt,
            chain,
            s.priority,
        ]

    @classmethod
    def decode(cls, m: list[Any]) -> Admit:
        _, gid, deployment, api, rid, caller, left, salt, chain, priority = m
        return cls(gid, deployment, api, rid, caller, left, salt, unpack(chain), priority)


@dataclass(frozen=True, slots=True)
class Next:
    """The engine provably never got request ``gid`` (``why``): the next instance, please."""

    TAG: ClassVar[str] = "N"
    gid: int
    why: str

    def encode(self) -> list[Any]:
        return [self.TAG, self.gid, self.why]

    @classmethod
    def decode(cls, m: list[Any]) -> Next:
        _, gid, why = m
        return cls(gid, why)


@dataclass(frozen=True, slots=True)
class End:
    """How request ``gid``'s exchange ended (what settlement needs)."""

    TAG: ClassVar[str] = "E"
    gid: int
    sent: bool
    completed: bool
    answered: bool
    cut: str | None

    def encode(self) -> list[Any]:
        return [self.TAG, self.gid, self.sent, self.completed, self.answered, self.cut]

    @classmethod
    def decode(cls, m: list[Any]) -> End:
        _, gid, sent, completed, answered, cut = m
        return cls(gid, sent, completed, answered, cut)


@dataclass(frozen=True, slots=True)
class Gone:
    """Request ``gid``'s client went before an offer came."""

    TAG: ClassVar[str] = "C"
    gid: int

    def encode(self) -> list[Any]:
        return [self.TAG, self.gid]

    @classmethod
    def decode(cls, m: list[Any]) -> Gone:
        _, gid = m
        return cls(gid)


@dataclass(frozen=True, slots=True)
class Counts:
    """One request's figures, for the authority's one set of counts."""

    TAG: ClassVar[str] = "F"
    figures: Figures

    def encode(self) -> list[Any]:
        return [self.TAG, list(self.figures)]

    @classmethod
    def decode(cls, m: list[Any]) -> Counts:
        _, figures = m
        return cls(Figures(*figures))


@dataclass(frozen=True, slots=True)
class Answered:
    """The engine's first output for request ``gid`` arrived (its settlement's rule is then
    the answered one, whatever becomes of the worker)."""

    TAG: ClassVar[str] = "W"
    gid: int

    def encode(self) -> list[Any]:
        return [self.TAG, self.gid]

    @classmethod
    def decode(cls, m: list[Any]) -> Answered:
        _, gid = m
        return cls(gid)


@dataclass(frozen=True, slots=True)
class Pong:
    """The worker's answer to ping ``n`` (it is alive)."""

    TAG: ClassVar[str] = "B"
    n: int

    def encode(self) -> list[Any]:
        return [self.TAG, self.n]

    @classmethod
    def decode(cls, m: list[Any]) -> Pong:
        _, n = m
        return cls(n)
