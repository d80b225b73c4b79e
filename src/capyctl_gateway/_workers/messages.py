"""What a worker and its authority say to each other: one frozen dataclass per message, each with
one `encode` (to the orjson array the line carries, its tag first) and one `decode` (from it).
`decode` dispatches on the tag; a message with an unknown tag or the wrong shape is a broken
peer (`ValueError`, and the line is closed).

Authority to worker: `Hello`, `Offer`, `Refused`, `Abort`, `Stop`, `Quit`. Worker to authority:
`Ready`, `Admit`, `Next`, `End`, `Gone`, `Counts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .._routing.prefix import pack, unpack
from .._tally import Figures

__all__ = [
    "Abort",
    "Admit",
    "Counts",
    "End",
    "Gone",
    "Hello",
    "Message",
    "Next",
    "Offer",
    "Quit",
    "Ready",
    "Refused",
    "Stop",
    "decode",
]


# --- authority -> worker -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Hello:
    """The authority's greeting: the configuration, the key, the worker's index and how many
    share the listener's bounds, and when the gateway started."""

    TAG: ClassVar[str] = "H"
    doc: dict[str, Any]

    def encode(self) -> list[Any]:
        return [self.TAG, self.doc]

    @classmethod
    def decode(cls, m: list[Any]) -> Hello:
        _, doc = m
        return cls(dict(doc))


@dataclass(frozen=True, slots=True)
class Offer:
    """Run request ``gid`` on instance ``instance`` at ``url`` (its slot was ``waited``
    seconds after its ADMIT arrived; ``gated``: a wait for a start or wake)."""

    TAG: ClassVar[str] = "O"
    gid: int
    instance: int
    url: str
    headers: dict[str, str]
    where: str
    abortable: bool
    waited: float | None
    gated: bool

    def encode(self) -> list[Any]:
        s = self
        return [s.TAG, s.gid, s.instance, s.url, s.headers, s.where, s.abortable, s.waited, s.gated]

    @classmethod
    def decode(cls, m: list[Any]) -> Offer:
        _, gid, instance, url, headers, where, abortable, waited, gated = m
        return cls(gid, instance, url, headers, where, abortable, waited, gated)


@dataclass(frozen=True, slots=True)
class Refused:
    """Request ``gid`` is refused: the error to answer it with (``engine``: an `EngineError`)."""

    TAG: ClassVar[str] = "X"
    gid: int
    engine: bool
    status: int
    code: str
    message: str
    retryable: bool
    detail: str | None
    waited: float | None
    gated: bool

    def encode(self) -> list[Any]:
        s = self
        return [
            s.TAG,
            s.gid,
            s.engine,
            s.status,
            s.code,
            s.message,
            s.retryable,
            s.detail,
            s.waited,
            s.gated,
        ]

    @classmethod
    def decode(cls, m: list[Any]) -> Refused:
        _, gid, engine, status, code, message, retryable, detail, waited, gated = m
        return cls(gid, engine, status, code, message, retryable, detail, waited, gated)


@dataclass(frozen=True, slots=True)
class Abort:
    """End request ``gid``'s exchange now (a host lost, the gateway stopping, an operator's
    stop)."""

    TAG: ClassVar[str] = "K"
    gid: int
    why: str
    code: str
    """What its client hears (`ended_by_gateway`)."""

    def encode(self) -> list[Any]:
        return [self.TAG, self.gid, self.why, self.code]

    @classmethod
    def decode(cls, m: list[Any]) -> Abort:
        _, gid, why, code = m
        return cls(gid, why, code)


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop listening: the gateway is stopping."""

    TAG: ClassVar[str] = "S"

    def encode(self) -> list[Any]:
        return [self.TAG]

    @classmethod
    def decode(cls, m: list[Any]) -> Stop:
        (_,) = m
        return cls()


@dataclass(frozen=True, slots=True)
class Quit:
    """The requests still open were ended: finish their last words and exit."""

    TAG: ClassVar[str] = "Q"

    def encode(self) -> list[Any]:
        return [self.TAG]

    @classmethod
    def decode(cls, m: list[Any]) -> Quit:
        (_,) = m
        return cls()


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
    """Place request ``gid`` (its deployment, API, IDs and routing facts: its salt and its
    prefix fingerprints, never its body; ``left``: seconds before its deadline when it was
    sent)."""

    TAG: ClassVar[str] = "A"
    gid: int
    deployment: str
    api: str
    rid: str
    caller: str | None
    left: float
    salt: str | None
    prefix: tuple[int, ...]

    def encode(self) -> list[Any]:
        s = self
        chain = pack(s.prefix)
        return [s.TAG, s.gid, s.deployment, s.api, s.rid, s.caller, s.left, s.salt, chain]

    @classmethod
    def decode(cls, m: list[Any]) -> Admit:
        _, gid, deployment, api, rid, caller, left, salt, chain = m
        return cls(gid, deployment, api, rid, caller, left, salt, unpack(chain))


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


Message = Hello | Offer | Refused | Abort | Stop | Quit | Ready | Admit | Next | End | Gone | Counts
_DECODERS = {
    kind.TAG: kind.decode
    for kind in (Hello, Offer, Refused, Abort, Stop, Quit, Ready, Admit, Next, End, Gone, Counts)
}


def decode(m: Any) -> Message:
    """The message ``m`` (an array as the line carried it). Raises ValueError for one that is
    not a message this line speaks."""
    if not isinstance(m, list) or not m or not isinstance(m[0], str):
        raise ValueError("not a message")
    decoder = _DECODERS.get(m[0])
    if decoder is None:
        raise ValueError(f"no message is tagged {m[0]!r}")
    try:
        return decoder(m)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a malformed {m[0]!r} message: {exc}") from None
