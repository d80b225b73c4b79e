"""What a worker and its authority say to each other: one frozen dataclass per message, each with
one `encode` (to the orjson array the line carries, its tag first) and one `decode` (from it).
`decode` dispatches on the tag; a message with an unknown tag or the wrong shape is a broken
peer (`ValueError`, and the line is closed).

Authority to worker: `Hello`, `Offer`, `Refused`, `Abort`, `Stop`, `Quit`, `Ping` (here). Worker
to authority: `Ready`, `Admit`, `Next`, `End`, `Gone`, `Counts`, `Answered`, `Pong`
(``words.py``).

Each side knows the other alive by what it hears: the authority pings every `PING_S`, and a
worker it has not heard from for `FROZEN_S` is killed and started again (``_cli_workers.py``);
a worker that has not heard its authority for `FROZEN_S` refuses new requests at once (503),
and each request waiting for the authority's word ends at its deadline whatever it says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .words import Admit, Answered, Counts, End, Gone, Next, Pong, Ready

__all__ = [
    "FROZEN_S",
    "PING_S",
    "Abort",
    "Admit",
    "Answered",
    "Counts",
    "End",
    "Gone",
    "Hello",
    "Message",
    "Next",
    "Offer",
    "Ping",
    "Pong",
    "Quit",
    "Ready",
    "Refused",
    "Stop",
    "decode",
]


PING_S = 1.0
"""How often the authority pings each worker."""
FROZEN_S = 5.0
"""Silence after which either side takes the other for frozen (a stopped process, a blocked
loop): five pings missed."""


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


@dataclass(frozen=True, slots=True)
class Ping:
    """The authority's heartbeat (every `PING_S`): the worker answers `Pong` at once."""

    TAG: ClassVar[str] = "P"
    n: int

    def encode(self) -> list[Any]:
        return [self.TAG, self.n]

    @classmethod
    def decode(cls, m: list[Any]) -> Ping:
        _, n = m
        return cls(n)


_TO_WORKER = Hello | Offer | Refused | Abort | Stop | Quit | Ping
_TO_AUTHORITY = Ready | Admit | Next | End | Gone | Counts | Answered | Pong
Message = _TO_WORKER | _TO_AUTHORITY
_DECODERS = {
    kind.TAG: kind.decode
    for kind in (
        *(Hello, Offer, Refused, Abort, Stop, Quit, Ping),
        *(Ready, Admit, Next, End, Gone, Counts, Answered, Pong),
    )
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
