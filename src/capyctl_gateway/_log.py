"""Log output: human lines on a terminal, one JSON object per line with ``--log-format json``.

Records that describe a gateway event carry ``extra={"event": name, "fields": {...}}``; the JSON
formatter writes those fields, the text formatter the message. Keys and prompts are never logged.

In JSON mode every line goes through `JsonLines`, which writes what one event-loop iteration
logged in one write, and `event` hands it its line directly, without a ``LogRecord``: a line
per request is on the gateway's hot path. Lines keep their order either way. While someone
reads the live event stream (``_events.py``), each event is handed to it as well. What is fit
to log of a command line or an engine's output is ``_masking.py``'s (`masked`, `shown`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any, BinaryIO

import orjson

from ._events import BUS, PER_REQUEST
from ._loop import running_loop
from ._masking import masked, secrets_in, shown

__all__ = [
    "JsonFormatter",
    "JsonLines",
    "SparseLog",
    "shown",
    "TextFormatter",
    "configure_logging",
    "event",
    "masked",
    "secrets_in",
]

logger = logging.getLogger("capyctl_gateway")
_root = logging.getLogger()


def event(name: str, message: str, /, *args: object, **fields: Any) -> None:
    """Log one gateway event at INFO: ``message % args`` for people, ``fields`` for machines
    (the message is only formatted when a person will read it). The console's live stream
    (`_events.BUS`) gets it too while someone subscribes, and keeps it among the recent events
    unless it is about one request."""
    if BUS.subscribers or PER_REQUEST not in fields:
        BUS.publish(name, fields)
    handlers = _root.handlers
    if (
        len(handlers) == 1
        and type(handlers[0]) is JsonLines
        and handlers[0].direct
        and logger.isEnabledFor(logging.INFO)
    ):
        line = {"ts": round(time.time(), 3), "level": "info", "event": name, **fields}
        handlers[0].add(orjson.dumps(line))
        return
    logger.info(message, *args, extra={"event": name, "fields": fields})


class SparseLog:
    """At most one line per ``every_s`` for a kind of event; the next line counts the rest."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s = every_s
        self._last = -float("inf")
        self._skipped = 0

    def warning(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._skipped += 1
            return
        if self._skipped:
            message += f" ({self._skipped} more like it not logged)"
            self._skipped = 0
        self._last = now
        logger.warning(message, *args)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        message = record.getMessage()
        if record.levelno >= logging.WARNING:
            message = f"{record.levelname.lower()}: {message}"
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return f"{stamp} {message}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname.lower()}
        name = getattr(record, "event", None)
        if name is not None:
            out["event"] = name
            out.update(getattr(record, "fields", {}))
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out).decode()


class JsonLines(logging.Handler):
    """JSON lines to a binary stream: the lines logged in one event-loop iteration leave in
    one write at its end; outside a running loop, each line at once."""

    def __init__(self, stream: BinaryIO) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self._stream = stream
        self._lines: list[bytes] = []
        self._flush_on: asyncio.AbstractEventLoop | None = None
        """The loop a flush is scheduled on, if any."""

    @property
    def direct(self) -> bool:
        """Whether `event` may hand this handler its line without a record: nothing here or
        on the gateway's loggers would filter an INFO record out."""
        return self.level <= logging.INFO and not self.filters and not logger.filters

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record).encode()
        except Exception:
            self.handleError(record)
            return
        self.add(line)

    def add(self, line: bytes) -> None:
        """Queue one line (without its newline)."""
        with self.lock:  # type: ignore[union-attr]
            self._lines.append(line)
            try:
                loop: asyncio.AbstractEventLoop | None = running_loop()
            except RuntimeError:
                loop = None
            if loop is not None and loop is self._flush_on:
                return
            if loop is not None:
                # Also when a flush is still scheduled on a loop that stopped before running it.
                self._flush_on = loop
                loop.call_soon(self.flush)
                return
        self.flush()

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            self._flush_on = None
            if not self._lines:
                return
            data = b"\n".join(self._lines) + b"\n"
            self._lines.clear()
            try:
                self._stream.write(data)
                self._stream.flush()
            except (OSError, ValueError):
                pass  # stderr closed or gone: nowhere left to report it

    def close(self) -> None:
        self.flush()
        super().close()


def configure_logging(fmt: str) -> None:
    handler: logging.Handler
    if fmt == "json":
        handler = JsonLines(sys.stderr.buffer)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
