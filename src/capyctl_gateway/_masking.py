"""Masking secrets in what the gateway shows and logs: a command line (`shown`), free text such
as an engine's output or its refusal (`masked`), and the secrets a command and its environment
carry (`secrets_in`), which a pod's spec must not hold. Pure; imports nothing of the gateway."""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["masked", "secrets_in", "shown"]

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
