"""One-time tickets that open the console without the key in a URL.

A URL with the key in its fragment never reaches the gateway, but the browser keeps it: in its
history file, its address-bar suggestions, and wherever it syncs them. So ``capyctl console``
asks the management API for a ticket (with the key) and prints a URL that carries the ticket
instead; the page trades it for the key once, keeps the key in the tab's session storage, and
drops the fragment. A ticket is good for one trade and `TICKET_TTL_S`; at most `MAX_TICKETS` are
open at once (the oldest goes first). What stays in the browser's history opens nothing.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import orjson
from aiohttp import web

from .._clock import stamp
from .._errors import GatewayError, InvalidRequestError
from .._gateway import Gateway
from .._http.answers import error_response
from .._ulid import REQUEST_ID, new_ulid
from .keyed import Handler, json_answer, keyed

__all__ = ["MAX_TICKETS", "TICKET_TTL_S", "Tickets", "add_ticket_routes"]

TICKET_TTL_S = 60.0
"""How long a ticket can be traded for the key."""
MAX_TICKETS = 16
"""Tickets open at once; a new one past this drops the oldest."""
MAX_REDEEM_BYTES = 1024
"""The most a trade's body may be (a ticket is 32 characters)."""


class Tickets:
    """The tickets issued and not yet traded, each with when it expires."""

    def __init__(self, clock: Callable[[], float] = stamp) -> None:
        self._clock = clock
        self._open: dict[str, float] = {}

    def issue(self) -> str:
        now = self._clock()
        self._open = {t: until for t, until in self._open.items() if until > now}
        while len(self._open) >= MAX_TICKETS:
            del self._open[next(iter(self._open))]  # the oldest (dicts keep their order)
        ticket = secrets.token_urlsafe(24)
        self._open[ticket] = now + TICKET_TTL_S
        return ticket

    def redeem(self, ticket: str) -> bool:
        """Whether ``ticket`` was open and unexpired; it is closed either way."""
        until = self._open.pop(ticket, None)
        return until is not None and until > self._clock()

    def __len__(self) -> int:
        return len(self._open)


def add_ticket_routes(app: web.Application, gateway: Gateway, tickets: Tickets) -> None:
    """``POST /management/v1/console/tickets`` (with the key): a new ticket.
    ``POST /management/v1/console/redeem`` (``{"ticket": ...}``, no key): the key, once."""
    app.router.add_post("/management/v1/console/tickets", _issue(gateway, tickets))
    app.router.add_post("/management/v1/console/redeem", _redeem(gateway, tickets))


_PRIVATE = {"Cache-Control": "no-store"}


def _issue(gateway: Gateway, tickets: Tickets) -> Handler:
    async def issue(request: web.Request, rid: str) -> web.Response:
        doc = {"ticket": tickets.issue(), "expires_in_s": TICKET_TTL_S}
        return json_answer(doc, rid, _PRIVATE)

    return keyed(gateway, issue)


def _redeem(gateway: Gateway, tickets: Tickets) -> Handler:
    async def redeem(request: web.Request) -> web.Response:
        rid = new_ulid()
        headers = {REQUEST_ID: rid, **_PRIVATE}
        try:
            raw = await request.content.read(MAX_REDEEM_BYTES + 1)
            if len(raw) > MAX_REDEEM_BYTES:
                raise InvalidRequestError(f"a ticket's body is at most {MAX_REDEEM_BYTES} bytes")
            try:
                ticket = orjson.loads(raw).get("ticket")
            except (orjson.JSONDecodeError, AttributeError):
                raise InvalidRequestError('the body is {"ticket": "..."}') from None
            if not isinstance(ticket, str) or not tickets.redeem(ticket):
                raise GatewayError(
                    "the ticket is unknown, used or expired: run capyctl console again",
                    status=401,
                    code="unauthorized",
                )
        except GatewayError as err:
            return error_response(err, headers)
        return json_answer({"key": gateway.key_to_share()}, rid, _PRIVATE)

    return redeem
