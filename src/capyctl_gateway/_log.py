"""Log output: human lines on a terminal, one JSON object per line with ``--log-format json``.

Records that describe a gateway event carry ``extra={"event": name, "fields": {...}}``; the JSON
formatter writes those fields, the text formatter the message. Keys and prompts are never logged.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

__all__ = ["JsonFormatter", "TextFormatter", "configure_logging", "event"]

logger = logging.getLogger("capyctl_gateway")


def event(name: str, message: str, /, **fields: Any) -> None:
    """Log one gateway event at INFO."""
    logger.info(message, extra={"event": name, "fields": fields})


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


def configure_logging(fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
