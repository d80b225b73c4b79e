"""Log output: human lines on a terminal, one JSON object per line with ``--log-format json``.

Records that describe a gateway event carry ``extra={"event": name, "fields": {...}}``; the JSON
formatter writes those fields, the text formatter the message. Keys and prompts are never logged.

In JSON mode every line goes through `JsonLines`, which writes what one event-loop iteration
logged in one write, and `event` hands it its line directly, without a ``LogRecord``: a line
per request is on the gateway's hot path. Lines keep their order either way. While someone
reads the live event stream (``_events.py``), each event is handed to it as well.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
from collections.abc import Iterable
from typing import Any, BinaryIO

import orjson

from ._events import BUS, PER_REQUEST
from ._loop import running_loop

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


_SECRET_WORD = r"key|tokens?|secret|password"  # noqa: S105 (names, not a password)
"""What names a secret: a key, a token (or tokens), a secret or a password."""
_SHORT = r"hft"
"""Short flags that name a secret without saying so: llama-server's ``-hft`` (``--hf-token``)."""
_SECRET_NAME = re.compile(_SECRET_WORD + r"|^-" + _SHORT + r"$", re.IGNORECASE)
_KEY_NAME = re.compile(r"key|secret|password|^-?" + _SHORT + r"$", re.IGNORECASE)
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _hides(name: str, value: str) -> bool:
    """Whether ``value``, given under a ``name`` that says secret, is masked: all but a number
    under a name that says token(s) and nothing else (a count: ``n_tokens = 20``,
    ``--max-tokens 64``); a key, secret or password is masked even when it is all digits."""
    return _NUMBER.fullmatch(value) is None or _KEY_NAME.search(name) is not None


_USERINFO = re.compile(r"(?i)(?P<head>\b[a-z][a-z0-9+.-]*://)(?P<info>[^\s/@'\"?#]+)(?=@)")
"""A URL's userinfo (``https://user:secret@host``, ``https://TOKEN@host``): all of it is a
secret's, since a token is often given as the user name."""


def _hide_userinfo(m: re.Match[str]) -> str:
    return m.group("head") + "***"


def shown(argv: list[str]) -> list[str]:
    """A command line fit to show: the value of any flag that names a key, token, secret or
    password is masked (``--api-key X``, ``--api-key=X``), but for a count of tokens; so is a
    URL's userinfo in any argument."""
    out: list[str] = []
    secret_flag = ""
    for arg in argv:
        name, eq, value = arg.partition("=")
        secret = arg.startswith("-") and _SECRET_NAME.search(name) is not None
        if secret_flag:
            out.append("***" if _hides(secret_flag, arg) else arg)
        elif secret and eq and _hides(name, value):
            out.append(f"{name}=***")
        else:
            out.append(_USERINFO.sub(_hide_userinfo, arg))
        secret_flag = name if secret and not eq else ""
    return out


_REPR_SEP = r"""['"][ \t]*,[ \t]*['"]"""
"""What separates two strings in a tuple's or a list's repr: ``', '``."""
_SECRET_TEXT = re.compile(
    r"(?i)(?P<flag>(?<![\w-])--?(?P<fname>[\w-]*(?:"
    + _SECRET_WORD
    + r")[\w-]*|"
    + _SHORT
    + r")(?:[ \t]+|"
    + _REPR_SEP
    + r"))(?P<fvalue>[^\s'\",})\]]+)"
    # a header that carries a credential, whatever its scheme: Authorization: Token X
    r"|(?P<auth>\b(?:proxy-)?authorization(?:['\"]?[ \t]*[:=]|['\"][ \t]*,)[ \t]*['\"]?"
    r"(?:[a-z][\w-]*[ \t]+(?=[^\s'\",})\]]))?)[^\s'\",})\]]+"
    # a pair whose value is a list, as a repr writes one: 'api_key': ['sk-...', 'sk-...']
    r"|(?P<lpair>(?P<lname>[\w-]*(?:" + _SECRET_WORD + r")[\w-]*)['\"]?[ \t]*[:=][ \t]*\[)"
    r"(?P<lbody>[^\]\n]*)"
    # a pair as a tuple's repr writes it: ('api_key', 'sk-...')
    r"|(?P<tpair>['\"](?P<tname>[\w-]*(?:" + _SECRET_WORD + r")[\w-]*)" + _REPR_SEP + r")"
    r"(?P<tvalue>[^\s'\",})\]-][^\s'\",})\]]*)"  # not a flag: ['ENGINE_KEY', '--port']
    r"|(?P<pair>(?P<pname>[\w-]*(?:" + _SECRET_WORD + r")[\w-]*)['\"]?[ \t]*[:=][ \t]*['\"]?)"
    r"(?P<pvalue>[^\s'\",}]+)"
    r"|(?P<bearer>\b(?:bearer|basic)[ \t]+)[^\s'\",}]+"
    # a URL's userinfo: https://user:secret@host, https://TOKEN@host
    r"|(?P<userinfo>\b[a-z][a-z0-9+.-]*://)[^\s/@'\"?#]+(?=@)"
)
_LIST_ITEM = re.compile(r"""(?P<q>['"]?)(?P<v>[^\s'",\]]+)""")


def _mask(m: re.Match[str]) -> str:
    if m.group("bearer"):
        return m.group("bearer") + "***"
    if m.group("auth"):
        return m.group("auth") + "***"
    if m.group("userinfo"):
        return m.group("userinfo") + "***"
    if m.group("lpair"):
        name = m.group("lname")
        body = _LIST_ITEM.sub(
            lambda i: i["q"] + ("***" if _hides(name, i["v"]) else i["v"]), m.group("lbody")
        )
        return m.group("lpair") + body
    if m.group("flag"):
        name, value, head = m.group("fname"), m.group("fvalue"), m.group("flag")
    elif m.group("tpair"):
        name, value, head = m.group("tname"), m.group("tvalue"), m.group("tpair")
    else:
        name, value, head = m.group("pname"), m.group("pvalue"), m.group("pair")
    return head + "***" if _hides(name, value) else m.group(0)


def secrets_in(argv: list[str], env: dict[str, str]) -> list[str]:
    """The values that `shown` masks in ``argv`` (of a URL, its userinfo), and those of the
    variables in ``env`` whose names say key, token, secret or password (but for a count of
    tokens: ``MAX_TOKENS=64``), or the userinfo of a URL in any variable."""
    found: list[str] = []
    for arg, seen in zip(argv, shown(argv), strict=True):
        if seen == arg:
            continue
        if seen == _USERINFO.sub(_hide_userinfo, arg):
            found += (m["info"] for m in _USERINFO.finditer(arg))
        else:
            found.append(arg.partition("=")[2] if arg.startswith("-") else arg)
    for k, v in env.items():
        if _SECRET_NAME.search(k) and _hides(k, v):
            found.append(v)
        else:
            found += (m["info"] for m in _USERINFO.finditer(v))
    return [s for s in found if s]


def masked(text: str, secrets: Iterable[str | None] = ()) -> str:
    """Free text (an engine's output) fit to log: each of ``secrets`` masked wherever it
    appears, and the value after anything that names a key, token, secret or password
    (``--api-key X``, ``api_key: X``, ``HF_TOKEN=X``, each item of ``'api_key': [...]``, and
    as a tuple's or a list's repr writes them: ``('--api-key', 'X')``), an ``Authorization``
    header's credential whatever its scheme, a ``Bearer`` and a URL's userinfo, masked as
    `shown` masks a command line's."""
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, "***")
    return _SECRET_TEXT.sub(_mask, text)
