"""One listener's connection bounds, and the lines it logs when it reaches them (each at most
once a second)."""

from __future__ import annotations

from .._log import SparseLog

__all__ = ["Limits"]


class Limits:
    """One listener's connection bounds (the public one's from ``limits:`` in the configuration).

    ``listener`` names it in the log lines ("" for the public listener, whose lines name the
    configuration keys); ``busy_headers`` are header lines added to its 503 for a connection
    past the cap (a host's ingress marks it as never forwarded)."""

    __slots__ = (
        "busy_headers",
        "header_timeout",
        "idle_log",
        "keepalive_timeout",
        "listener",
        "max_connections",
        "protocol_log",
        "refusal_log",
    )

    def __init__(
        self,
        *,
        max_connections: int,
        header_timeout: float,
        keepalive_timeout: float,
        listener: str = "",
        busy_headers: bytes = b"",
    ) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.keepalive_timeout = keepalive_timeout
        self.idle_log = SparseLog()
        self.listener = listener
        self.busy_headers = busy_headers
        self.protocol_log = SparseLog()
        self.refusal_log = SparseLog()

    def cap(self) -> str:
        """How the log names the connection cap."""
        if not self.listener:
            return f"the gateway holds limits.max_connections ({self.max_connections})"
        return f"the {self.listener} holds its {self.max_connections} connections"

    def head(self) -> str:
        """How the log names the head timeout."""
        within = f"no complete request head within {self.header_timeout:g} s"
        if not self.listener:
            return f"{within} (limits.header_timeout)"
        return f"{within} (the {self.listener}'s bound)"
