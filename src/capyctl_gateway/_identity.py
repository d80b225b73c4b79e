"""The gateway's API key: written once, owner-only, never logged."""

from __future__ import annotations

import json
import os
import secrets
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from ._errors import OperatorError

__all__ = [
    "CredentialsError",
    "check_private",
    "credentials_path",
    "load_or_create_api_key",
    "load_or_create_server_key",
    "read_api_key",
    "server_credentials_path",
]


class CredentialsError(OperatorError):
    """The credentials file exists but cannot be used: the gateway must not start."""


def credentials_path(state_dir: Path) -> Path:
    return state_dir / "identity" / "credentials"


def server_credentials_path(state_dir: Path) -> Path:
    return state_dir / "identity" / "server-credentials.json"


def load_or_create_server_key(state_dir: Path) -> str:
    """The server role's key: ``<state>/identity/server-credentials.json``, a JSON object with
    ``"api_key"``, written (0600) on first start. The same checks as the single machine's."""
    path = server_credentials_path(state_dir)
    if not path.exists():
        if path.parent.is_dir():
            _check_directory(path.parent)
        return _create(path, lambda key: json.dumps({"api_key": key}) + "\n", _read_server_key)
    return _read_server_key(path)


def _read_server_key(path: Path) -> str:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CredentialsError(f"cannot read the credentials file {path}: {exc}") from exc
    key = doc.get("api_key") if isinstance(doc, dict) else None
    if not isinstance(key, str) or len(key) < 32:
        raise CredentialsError(f'{path} has no usable "api_key"')
    _check_private(path)
    return key


def load_or_create_api_key(state_dir: Path) -> str:
    """Read ``<state>/identity/credentials`` (line ``api_key: <key>``), creating it on first start.

    The key is 256 random bits (43 URL-safe characters). A file that exists but cannot be read,
    or has no usable ``api_key`` line, raises `CredentialsError`: there is no fallback key.
    """
    path = credentials_path(state_dir)
    try:
        return read_api_key(state_dir)
    except FileNotFoundError:
        pass
    if path.parent.is_dir():
        _check_directory(path.parent)
    return _create(path, lambda key: f"api_key: {key}\n", lambda p: read_api_key(p.parent.parent))


def read_api_key(state_dir: Path) -> str:
    """The key of an existing credentials file (FileNotFoundError when there is none)."""
    path = credentials_path(state_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as exc:
        raise CredentialsError(f"cannot read the credentials file {path}: {exc}") from exc
    for line in text.splitlines():
        if line.startswith("api_key: "):
            key = line.removeprefix("api_key: ").strip()
            if len(key) >= 32:
                _check_private(path)
                return key
            raise CredentialsError(f"the api_key in {path} is too short to be a real key")
    raise CredentialsError(f"the credentials file {path} has no 'api_key: ' line")


def check_private(path: Path) -> None:
    """Refuse a private key or credentials file others could read or replace
    (CredentialsError, with the ``chmod`` that fixes it)."""
    _check_private(path)


def _check_private(path: Path) -> None:
    """Refuse a key other users could read or replace, as ssh refuses such a private key: a key
    that was readable may already be known, and fixing the mode is the owner's call."""
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise CredentialsError(
            f"the credentials file {path} belongs to another user (uid {st.st_uid}); "
            "the gateway uses only a key file of its own user"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise CredentialsError(
            f"the credentials file {path} is open to other users (mode {mode:04o}), so its key "
            f"may be known: make it private with `chmod 600 {path}`, or delete it to have a "
            "new key written at the next start"
        )
    _check_directory(path.parent)


def _check_directory(directory: Path) -> None:
    mode = stat.S_IMODE(directory.stat().st_mode)
    if mode & 0o022:
        raise CredentialsError(
            f"the identity directory {directory} can be written by other users "
            f"(mode {mode:04o}), who could replace the key: `chmod 700 {directory}`"
        )


def _create(path: Path, text: Callable[[str], str], reread: Callable[[Path], str]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_urlsafe(32)
    # Write the whole file aside, then link it into place: a reader never sees a half-written
    # file, and when two gateways start at once the second link fails and it reads the first's.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".credentials-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text(key))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, stat.S_IRUSR | stat.S_IWUSR)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return reread(path)
    finally:
        os.unlink(tmp)
    return key
