"""Label and field selectors as the API server parses them (k8s.io/apimachinery labels.Parse,
fields.ParseSelector), plus the label key/value rules that validation shares.

Label selectors: ``a=b``, ``a==b``, ``a!=b``, ``a``, ``!a``, ``a in (x,y)``, ``a notin (x)``,
``a>1``, ``a<1``; a comma is AND. Field selectors: ``f=v``, ``f==v``, ``f!=v``; which fields may
be named is up to the caller (the real server allows a fixed set per resource). Departure: field
selector values cannot hold escaped ``,``/``=`` (the real parser accepts ``\\,``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = [
    "FieldSelector",
    "LabelSelector",
    "SelectorError",
    "label_key_error",
    "label_value_error",
]

_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_TOKEN = re.compile(r"\s*(==|!=|=|!|\(|\)|,|>|<|[^\s,=!()<>]+)")
_NAME_RULE = (
    "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
    "alphanumeric character"
)


class SelectorError(ValueError):
    """A selector the server refuses (400 BadRequest); the text is the Status message."""


def label_key_error(key: str) -> str | None:
    """Why ``key`` is not a valid label key (a qualified name), or None."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return f"prefix part must be a lowercase RFC 1123 subdomain: {key!r}"
    if not name or len(name) > 63 or not _NAME.match(name):
        return f"name part {_NAME_RULE} (63 characters at most): {key!r}"
    return None


def label_value_error(value: str) -> str | None:
    """Why ``value`` is not a valid label value, or None (empty is valid)."""
    if value and (len(value) > 63 or not _NAME.match(value)):
        return f"a valid label value {_NAME_RULE} (63 characters at most): {value!r}"
    return None


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!", ">", "<"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        have = labels.get(self.key)
        if self.op in ("=", "in"):
            return have is not None and have in self.values
        if self.op in ("!=", "notin"):
            return have is None or have not in self.values
        if self.op == "exists":
            return have is not None
        if self.op == "!":
            return have is None
        if have is None or not re.fullmatch(r"-?\d+", have):
            return False
        return (
            int(have) > int(self.values[0]) if self.op == ">" else int(have) < int(self.values[0])
        )


class _Tokens:
    def __init__(self, text: str) -> None:
        self.items: list[str] = []
        pos, text = 0, text.strip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:  # only trailing blanks are left
                break
            self.items.append(m.group(1))
            pos = m.end()
        self.at = 0

    def peek(self) -> str | None:
        return self.items[self.at] if self.at < len(self.items) else None

    def take(self) -> str | None:
        tok = self.peek()
        self.at += tok is not None
        return tok


def _identifier(tok: str | None, what: str) -> str:
    if tok is None or tok in ("==", "!=", "=", "!", "(", ")", ",", ">", "<"):
        raise SelectorError(f"unable to parse requirement: found '{tok or ''}', expected: {what}")
    return tok


def _value(tok: str) -> str:
    if (err := label_value_error(tok)) is not None:
        raise SelectorError(f"unable to parse requirement: values[0]: Invalid value: {err}")
    return tok


@dataclass(frozen=True)
class LabelSelector:
    requirements: tuple[Requirement, ...]

    @classmethod
    def parse(cls, text: str | None) -> LabelSelector:
        toks, reqs = _Tokens(text or ""), []
        while toks.peek() is not None:
            reqs.append(cls._requirement(toks))
            sep = toks.take()
            if sep is not None and sep != ",":
                raise SelectorError(f"found '{sep}', expected: ',' or 'end of string'")
            if sep == "," and toks.peek() is None:
                raise SelectorError("found '', expected: identifier after ','")
        return cls(tuple(reqs))

    @staticmethod
    def _requirement(toks: _Tokens) -> Requirement:
        if toks.peek() == "!":
            toks.take()
            key = _identifier(toks.take(), "identifier after '!'")
            return Requirement(_key(key), "!")
        key = _key(_identifier(toks.take(), "identifier"))
        op = toks.peek()
        if op is None or op == ",":
            return Requirement(key, "exists")
        toks.take()
        if op in ("=", "==", "!="):
            val = toks.peek()
            if val is None or val == ",":
                return Requirement(key, "=" if op != "!=" else "!=", ("",))
            return Requirement(
                key, "=" if op != "!=" else "!=", (_value(_identifier(toks.take(), "value")),)
            )
        if op in (">", "<"):
            val = _identifier(toks.take(), "value")
            if not re.fullmatch(r"-?\d+", val):
                raise SelectorError(
                    f"unable to parse requirement: for 'Gt', 'Lt' operators, the value must be an integer: {val!r}"
                )
            return Requirement(key, op, (val,))
        if op in ("in", "notin"):
            if toks.take() != "(":
                raise SelectorError(
                    f"unable to parse requirement: found '{toks.peek() or ''}', expected: '('"
                )
            values: list[str] = []
            while True:
                tok = toks.take()
                if tok == ")" and not values:
                    raise SelectorError(
                        "unable to parse requirement: for 'in', 'notin' operators, values set can't be empty"
                    )
                if tok == ")":
                    break
                if tok == ",":
                    values.append("")  # an empty value between commas, as the real lexer reads it
                    continue
                values.append(_value(_identifier(tok, "value")))
                nxt = toks.take()
                if nxt == ")":
                    break
                if nxt != ",":
                    raise SelectorError(
                        f"unable to parse requirement: found '{nxt or ''}', expected: ',' or ')'"
                    )
            return Requirement(key, op, tuple(values))
        raise SelectorError(
            f"unable to parse requirement: found '{op}', expected: in, notin, =, ==, !=, gt, lt"
        )

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        return all(r.matches(labels or {}) for r in self.requirements)


def _key(key: str) -> str:
    if (err := label_key_error(key)) is not None:
        raise SelectorError(f"unable to parse requirement: key: Invalid value: {err}")
    return key


@dataclass(frozen=True)
class FieldSelector:
    terms: tuple[tuple[str, str, str], ...]  # (field, "=" | "!=", value)

    @classmethod
    def parse(cls, text: str | None, allowed: Callable[[str], bool]) -> FieldSelector:
        terms = []
        for part in (text or "").split(","):
            if not part.strip():
                continue
            m = re.fullmatch(r"\s*([^=!\s]+)\s*(==|=|!=)\s*([^\s]*)\s*", part)
            if m is None:
                raise SelectorError(f"invalid selector: '{text}'; can't understand '{part}'")
            field, op, value = m.groups()
            if not allowed(field):
                raise SelectorError(f"field label not supported: {field}")
            terms.append((field, "!=" if op == "!=" else "=", value))
        return cls(tuple(terms))

    def matches(self, fields: Callable[[str], str]) -> bool:
        return all((fields(f) == v) == (op == "=") for f, op, v in self.terms)
