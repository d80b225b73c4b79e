"""Recording real engines' answers, and the shapes the live tier compares them by.

Pure helpers for ``pytest contract -m live --record`` (see ``contract/live/test_recordings_live.py``):

* :func:`http_recording` / :func:`response_recording` turn an HTTP answer into our ``.http``
  format: ``HTTP/1.1 <code> <reason>``, the headers as received minus :data:`DROPPED_HEADERS`,
  a CRLF blank line, then the body as received. :func:`split_recording` reads one back.
* :func:`refresh_provenance` writes or refreshes a version folder's ``PROVENANCE.md``.
* :func:`json_shape`, :func:`prometheus_shape` and :func:`sse_shape` reduce an answer to what
  must not drift (key paths, label names), ignoring values; :func:`drift` names the difference.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable, Mapping, Sequence
from datetime import date
from pathlib import Path

import httpx

from canopyx_provider._prom import parse_samples
from canopyx_provider.adapters import _llamacpp, _vllm

__all__ = [
    "DROPPED_HEADERS",
    "LLAMACPP_FAMILIES",
    "RECORD_COMMAND",
    "RECORDED",
    "VLLM_FAMILIES",
    "JsonShape",
    "PromShape",
    "Shape",
    "command_line",
    "drift",
    "http_recording",
    "json_shape",
    "prometheus_shape",
    "refresh_provenance",
    "response_recording",
    "split_recording",
    "sse_shape",
]

RECORDED = Path(__file__).resolve().parent / "recorded"
RECORD_COMMAND = "pytest contract -m live --record"

# Framing and per-exchange headers: a replay sets its own, and they would only churn the diffs.
DROPPED_HEADERS = frozenset(
    {"date", "content-length", "transfer-encoding", "connection", "keep-alive"}
)

# The metric families the adapters read; cache_config_info is a label dictionary whose label
# names change between vLLM versions, so its whole set of label names is compared.
LLAMACPP_FAMILIES: tuple[str, ...] = tuple(_llamacpp._POLLED)
VLLM_FAMILIES: tuple[str, ...] = (*_vllm._POLLED, _vllm.CACHE_CONFIG)

JsonShape = frozenset[str]
PromShape = Mapping[str, frozenset[str]]
Shape = JsonShape | PromShape

DONE_MARKER = "data: [DONE]"


# --------------------------------------------------------------------------- .http files


def http_recording(
    status: int, reason: str, headers: Iterable[tuple[str, str]], body: bytes
) -> bytes:
    """An answer in our ``.http`` format (headers kept in order and case, minus the dropped)."""
    lines = [f"HTTP/1.1 {status} {reason}".rstrip()]
    lines += [f"{name}: {value}" for name, value in headers if name.lower() not in DROPPED_HEADERS]
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body


def _redact(data: bytes, redact: Mapping[str, str]) -> bytes:
    # Longest first, so that a path is replaced before any of its prefixes.
    for old in sorted(redact, key=len, reverse=True):
        data = data.replace(old.encode(), redact[old].encode())
    return data


def response_recording(
    resp: httpx.Response, *, body_only: bool = False, redact: Mapping[str, str] | None = None
) -> bytes:
    """An httpx response as an ``.http`` recording (or its body alone, for ``.sse`` files).

    ``redact`` replaces machine-specific strings (temporary paths) in head and body.

    Raises:
        ValueError: the body was content-encoded; ask with ``Accept-Encoding: identity``.
    """
    if "content-encoding" in resp.headers:
        raise ValueError(
            f"{resp.request.url} answered with Content-Encoding "
            f"{resp.headers['content-encoding']}: the body would not be as received"
        )
    if body_only:
        data = resp.content
    else:
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in resp.headers.raw]
        data = http_recording(resp.status_code, resp.reason_phrase, headers, resp.content)
    return _redact(data, redact or {})


def split_recording(raw: bytes) -> tuple[int | None, list[tuple[str, str]], bytes]:
    """Status, headers and body of a recording; a bare body (``.sse``) has no status."""
    if not raw.startswith(b"HTTP/"):
        return None, [], raw
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
    return status, headers, body


# --------------------------------------------------------------------------- PROVENANCE.md

_BEGIN = "<!-- begin: written by " + RECORD_COMMAND + " -->"
_END = "<!-- end: written by " + RECORD_COMMAND + " -->"


def command_line(argv: Sequence[str], *, redact: Mapping[str, str] | None = None) -> str:
    """``argv`` as a shell line, machine-specific strings redacted and the port as ``<free>``."""
    args = list(argv)
    for i, arg in enumerate(args[:-1]):
        if arg == "--port":
            args[i + 1] = "<free>"
    return _redact(shlex.join(args).encode(), redact or {}).decode()


def _section(
    *,
    engine: str,
    version: str,
    command: str,
    captured: date,
    files: Iterable[str],
    notes: Iterable[str],
    partial: bool,
) -> str:
    names = ", ".join(f"`{f}`" for f in sorted(files))
    bullets = [
        f"- Engine: {engine}, version {version}.",
        f"- Captured live by `{RECORD_COMMAND}` on {captured.isoformat()}, from a real server "
        "started by the contract suite on this project's kind of machine.",
        f"- Command: `{command}`",
        f"- Files: {names}.",
        "- `.http` files: status line, headers as received minus "
        + ", ".join(f"`{h}`" for h in sorted(DROPPED_HEADERS))
        + ", a blank line, the body as received. `.sse` files hold the streamed body alone.",
        *(f"- {note}" for note in notes),
    ]
    if partial:
        bullets.insert(
            0, "- This capture rewrote the files listed here; the notes above describe the rest."
        )
    title = f"## Captured live by `{RECORD_COMMAND}`"
    return "\n".join([_BEGIN, title, "", *bullets, _END]) + "\n"


def refresh_provenance(
    folder: Path,
    *,
    title: str,
    engine: str,
    version: str,
    command: str,
    captured: date,
    files: Iterable[str],
    notes: Iterable[str] = (),
) -> Path:
    """Write or refresh ``folder/PROVENANCE.md`` for a live capture of ``files``.

    If the capture covers every recording in the folder (subfolders included), the file is
    rewritten whole under ``title``. Otherwise the older notes still describe other files and
    are kept: only the section this function writes is replaced (or appended the first time).
    """
    files = sorted(files)
    path = folder / "PROVENANCE.md"
    others = {
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.name != "PROVENANCE.md"
    } - set(files)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    whole = not others or not old.strip()
    section = _section(
        engine=engine,
        version=version,
        command=command,
        captured=captured,
        files=files,
        notes=notes,
        partial=not whole,
    )
    if whole:
        text = f"# {title}\n\n{section}"
    elif _BEGIN in old and _END in old:
        before, _, rest = old.partition(_BEGIN)
        _, _, after = rest.partition(_END)
        text = before + section.rstrip("\n") + after
    else:
        text = old.rstrip("\n") + "\n\n" + section
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- shapes


def _key_paths(value: object, prefix: str, out: set[str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out.add(path)
            _key_paths(item, path, out)
    elif isinstance(value, list):
        for item in value:
            _key_paths(item, prefix + "[]", out)


def json_shape(body: bytes | str) -> JsonShape:
    """Every key path of a JSON document (``data[].id``, ``a.b.c``), values ignored.

    An empty body has the empty shape.
    """
    if not body.strip():
        return frozenset()
    out: set[str] = set()
    _key_paths(json.loads(body), "", out)
    return frozenset(out)


def prometheus_shape(text: str, families: Iterable[str]) -> PromShape:
    """For each of ``families`` that has samples in ``text``: the set of its label names."""
    samples = parse_samples(text, tuple(families))
    return {
        name: frozenset(label for s in found for label in s.labels)
        for name, found in samples.items()
        if found
    }


def _sse_chunks(body: str) -> tuple[list[dict[str, object]], bool]:
    chunks: list[dict[str, object]] = []
    done = False
    for line in body.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        if isinstance(chunk, dict):
            chunks.append(chunk)
    return chunks, done


def sse_shape(body: bytes | str) -> JsonShape:
    """The key paths of a streamed chat completion's chunks, values ignored.

    Top-level keys, the keys beside ``delta`` (``choices[].finish_reason``), the delta keys
    (``choices[].delta.content``), the usage keys and their detail keys
    (``usage.prompt_tokens_details.cached_tokens``), and ``data: [DONE]`` if it ends the stream.
    A recording that still carries an HTTP head is read past it.
    """
    text = body.decode() if isinstance(body, bytes) else body
    chunks, done = _sse_chunks(text)
    out: set[str] = {DONE_MARKER} if done else set()
    for chunk in chunks:
        out.update(chunk)
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            out.update(f"choices[].{k}" for k in choice)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                out.update(f"choices[].delta.{k}" for k in delta)
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            for key, value in usage.items():
                out.add(f"usage.{key}")
                if isinstance(value, dict):
                    out.update(f"usage.{key}.{k}" for k in value)
    return frozenset(out)


def _flat(shape: Shape) -> frozenset[str]:
    if isinstance(shape, frozenset):
        return shape
    out = set()
    for name, labels in shape.items():
        out.add(name)
        out.update(f"{name}{{{label}}}" for label in labels)
    return frozenset(out)


def drift(recorded: Shape, live: Shape) -> str | None:
    """None if the shapes are equal, else what the live answer added and removed.

    A metric family's label appears as ``family{label}``.
    """
    old, new = _flat(recorded), _flat(live)
    if old == new:
        return None
    parts = []
    if added := sorted(new - old):
        parts.append("added (live, not recorded): " + ", ".join(added))
    if removed := sorted(old - new):
        parts.append("removed (recorded, not live): " + ", ".join(removed))
    return "; ".join(parts)
