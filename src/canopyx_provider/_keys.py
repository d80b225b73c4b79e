"""Reading the engine's API key without putting it in source."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ._errors import ConfigError

__all__ = ["DEFAULT_KEY_ENV", "DEFAULT_KEY_FILE", "engine_api_key"]

DEFAULT_KEY_ENV = "CANOPYX_ENGINE_API_KEY"
DEFAULT_KEY_FILE = Path("~/.config/canopyx/engine-api-key")


def engine_api_key(
    *, env: str = DEFAULT_KEY_ENV, file: str | os.PathLike[str] | None = None
) -> str | None:
    """The engine's bearer credential, from the environment or an owner-only file.

    The variable ``env`` (default ``CANOPYX_ENGINE_API_KEY``) wins when set and not empty.
    Otherwise ``file`` (default ``~/.config/canopyx/engine-api-key``, or the path in
    ``CANOPYX_ENGINE_API_KEY_FILE``) is read when it exists: it must be a regular file that
    neither its group nor others can read or write (``chmod 600``). Its first line, stripped,
    is the key. Returns None when neither is there: the engine takes no key.

    Raises:
        ConfigError: the file is readable by others, empty, or cannot be read.
    """
    value = os.environ.get(env, "").strip()
    if value:
        return value
    path = Path(file or os.environ.get(f"{env}_FILE") or DEFAULT_KEY_FILE).expanduser()
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the engine key file {path}: {exc.strerror}") from exc
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"the engine key file {path} is not a regular file")
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"the engine key file {path} is open to other users "
            f"(mode {stat.S_IMODE(info.st_mode):o}); run: chmod 600 {path}"
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the engine key file {path}: {exc}") from exc
    key = lines[0].strip() if lines else ""
    if not key:
        raise ConfigError(f"the engine key file {path} is empty")
    return key
