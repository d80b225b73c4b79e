"""Reading request bodies within bounds: each body's size, the time it may take, and the bytes
all requests may hold at once (read and not yet released).

A body is charged to the budget for the bytes that arrived, as they arrive: a declared
``Content-Length`` only refuses a body over the per-request limit at once (413), it reserves
nothing. Otherwise connections that declare large bodies and send a few bytes would hold the
whole budget while they idle, and every other client would be refused. What one connection can
hold before its bytes are read is aiohttp's read buffer (it stops reading the socket past its
high-water mark). One client (an address: `client_of`) holds at most its share of the budget
(``limits.max_body_bytes_per_client``), so that its bodies cannot lock every other client out."""

from __future__ import annotations

import asyncio
import ipaddress

from aiohttp import web

from .._deployments.queue import BodyBudget
from .._errors import GatewayError, TooLargeError

__all__ = ["Body", "client_of"]


class Body:
    """One request's body as read, and the share of the budget it holds until `release`,
    counted against its client's share too (`client_of`)."""

    __slots__ = ("_budget", "_client", "held")

    def __init__(self, budget: BodyBudget, client: str = "") -> None:
        self._budget = budget
        self._client = client
        self.held = 0

    async def read(self, request: web.Request, limit: int, within_s: float) -> bytes:
        """The whole body: 413 as soon as it is known to be over ``limit``, 408 past
        ``within_s`` seconds, 503 when the gateway holds too many bodies already."""
        length = request.content_length
        if length is not None and length > limit:
            raise TooLargeError(f"the request body is over {limit} bytes")
        content = request.content
        if content.is_eof():  # the whole body came with the head: no wait, no timer
            data = content.read_nowait(-1)
            if len(data) > limit:
                raise TooLargeError(f"the request body is over {limit} bytes")
            self._take(len(data))
            return data
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(within_s):
                while block := await content.readany():
                    size += len(block)
                    if size > limit:
                        raise TooLargeError(f"the request body is over {limit} bytes")
                    if size > self.held:
                        self._take(size - self.held)
                    parts.append(block)
        except TimeoutError:
            raise GatewayError(
                "the request body did not arrive within limits.body_read_timeout",
                status=408,
                code="request_timeout",
            ) from None
        return b"".join(parts)

    def _take(self, n: int) -> None:
        self._budget.take(n, self._client)
        self.held += n

    def release(self) -> None:
        self._budget.give(self.held, self._client)
        self.held = 0


def client_of(peer: str | None) -> str:
    """Who a request from ``peer`` (its address) is counted against: that address; for IPv6,
    its /64 (what one host is given), an IPv4 address written as IPv6 as that IPv4 address."""
    if peer is None or ":" not in peer:
        return peer or ""
    try:
        address = ipaddress.IPv6Address(peer)
    except ValueError:
        return peer  # not an address aiohttp would give: as it is
    mapped = address.ipv4_mapped
    return str(mapped) if mapped is not None else address.exploded[:19]
