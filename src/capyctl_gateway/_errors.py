"""Errors the gateway answers with, as the documented ``{"code", "message"}`` objects.

Every refusal is a `GatewayError`: its ``code`` and ``status`` are the documented ones, and
``retryable`` adds ``"retryable": true`` (a 429 also carries ``Retry-After``). Before a stream has
started an error is an HTTP answer; after, it is one in-band ``data:`` event.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["GatewayError", "NotAcceptedError", "error_body", "error_event"]


class GatewayError(Exception):
    """A documented refusal: HTTP ``status``, machine ``code``, human ``message``."""

    def __init__(self, status: int, code: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retryable = retryable

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.retryable:
            out["retryable"] = True
        return out

    def __repr__(self) -> str:
        return f"GatewayError({self.status}, {self.code!r}, {self.message!r})"


class NotAcceptedError(Exception):
    """The engine provably never got the request (no connection): another instance may take it."""


def invalid(message: str) -> GatewayError:
    return GatewayError(400, "invalid_request", message)


def error_body(err: GatewayError) -> bytes:
    return orjson.dumps(err.body())


def error_event(err: GatewayError) -> bytes:
    """The in-band form, once a stream has started: one data event, never followed by [DONE]."""
    inner = {"code": err.code, "message": err.message, "retryable": err.retryable}
    return b"data: " + orjson.dumps({"error": inner}) + b"\n\n"
