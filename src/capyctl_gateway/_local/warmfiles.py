"""The warm cache's files on this machine, all the gateway's own, under its state directory:

    <state-dir>/warm/                        0700
      <deployment>/                          0700 (named as the engine's logs are: %XX)
        <index>/                             0700: the instance's engine saves its slots here
          manifest.json                      0600: the saved slots and the key they are under
          slot<N>-<nonce>.bin                0600: one slot's tokens and KV cells

A slot's file is written by the engine under a name of its own (``tmp-...``), checked (its size
is the engine's count), made 0600 and renamed into place, and only then named in the manifest,
which is itself written whole and renamed into place. So a save cut short (the gateway or the
engine killed in it) leaves at most a file no manifest names, and every file the manifest does
not name is removed when the instance next starts: nothing half written is ever restored. A
file is restored only while it is a regular file of the gateway's user, of the size recorded.

A deployment's directory goes when the deployment leaves the configuration (`prune`, when the
gateway starts). The model's identity (`model_identity`) and the flags' hash (`flags_hash`) are
what a saved cache's key holds of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from .._deployments.warm import Saved, SavedSlot
from .enginelog import file_stem

__all__ = [
    "MANIFEST",
    "InstanceDir",
    "flags_hash",
    "model_identity",
    "prune",
]

MANIFEST = "manifest.json"
SAMPLE_BYTES = 64 << 10
HEAD_BYTES = 1 << 20
SAMPLES = 16
"""A model file's identity reads its first `HEAD_BYTES` (a GGUF's header and metadata) and
`SAMPLES` pieces of `SAMPLE_BYTES` spread through the rest (its weights): 2 MiB in all."""

# Flags that cannot change what a slot's cache holds, with whether each takes a value: they are
# left out of the key, so that changing them keeps the cache (anything else is in it).
_NEUTRAL: Mapping[str, bool] = {
    "-t": True, "--threads": True, "-tb": True, "--threads-batch": True,
    "--threads-http": True, "-a": True, "--alias": True, "--api-key": True,
    "--api-key-file": True, "--metrics": False, "--slots": False, "--no-slots": False,
    "--props": False, "--log-file": True, "--log-colors": True, "--log-verbosity": True,
    "-lv": True, "-v": False, "--verbose": False, "--log-disable": False,
    "--log-prefix": False, "--log-timestamps": False, "-to": True, "--timeout": True,
    "-sps": True, "--slot-prompt-similarity": True, "-cram": True, "--cache-ram": True,
    "--cache-idle-slots": False, "--no-cache-idle-slots": False, "--no-webui": False,
    "--webui": False, "--path": True, "--ssl-key-file": True, "--ssl-cert-file": True,
    "-m": True, "--model": True, "--sleep-idle-seconds": True, "--no-warmup": False,
}  # fmt: skip
_NEUTRAL_ENV = frozenset(
    {"LLAMA_ARG_THREADS", "LLAMA_ARG_THREADS_BATCH", "LLAMA_ARG_THREADS_HTTP", "LLAMA_API_KEY",
     "LLAMA_ARG_ALIAS", "LLAMA_ARG_MODEL", "LLAMA_ARG_ENDPOINT_METRICS",
     "LLAMA_ARG_ENDPOINT_SLOTS", "LLAMA_ARG_CACHE_RAM", "LLAMA_ARG_NO_WEBUI"}
)  # fmt: skip


def flags_hash(command: Sequence[str], env: Mapping[str, str]) -> str:
    """A hash of what in an engine's launch may change what its cache holds: every flag of
    ``command`` (after the program) and every ``LLAMA_ARG_`` variable of ``env``, but the
    neutral ones (threads, logging, the alias, the key, the model's path: its content is the
    key's own part)."""
    kept: list[str] = []
    args = list(command[1:])
    i = 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name in _NEUTRAL:
            i += 2 if _NEUTRAL[name] and "=" not in args[i] else 1
            continue
        kept.append(args[i])
        i += 1
    kept += sorted(f"{k}={v}" for k, v in env.items() if k.startswith("LLAMA_ARG_"))
    kept = [k for k in kept if k.split("=", 1)[0] not in _NEUTRAL_ENV]
    return hashlib.sha256("\0".join(kept).encode()).hexdigest()


def model_identity(path: Path) -> str:
    """``<size>:<sha256>`` of the model file at ``path``: its size, its head and samples of
    the rest (see `SAMPLES`). Raises OSError where it cannot be read."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(f.read(HEAD_BYTES))
        span = max(size - HEAD_BYTES - SAMPLE_BYTES, 0)
        for n in range(SAMPLES):
            f.seek(HEAD_BYTES + span * n // max(SAMPLES - 1, 1))
            digest.update(f.read(SAMPLE_BYTES))
    return f"{size}:{digest.hexdigest()}"


def _stem(deployment: str) -> str:
    """A deployment's directory name: its logs' stem without the instance."""
    return file_stem(deployment, 0).removesuffix("-0")


def _private_dir(path: Path) -> None:
    """Make ``path`` (and its parents) a directory only the gateway's user can enter; raise
    OSError where it is a link or another user's."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OSError(f"{path} is not a directory of this user")
    if stat.S_IMODE(st.st_mode) != 0o700:
        path.chmod(0o700)


def prune(root: Path, names: Iterable[str]) -> list[str]:
    """Remove the directory of every deployment under ``root`` that ``names`` no longer has;
    the directories removed."""
    if not root.is_dir():
        return []
    kept = {_stem(n) for n in names}
    gone = []
    for entry in sorted(root.iterdir()):
        if entry.name not in kept and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            gone.append(entry.name)
    return gone


class InstanceDir:
    """One instance's directory: its manifest and its slot files (see the module's text)."""

    def __init__(self, root: Path, deployment: str, index: int) -> None:
        self.deployment = root / _stem(deployment)
        self.path = self.deployment / str(index)
        self._index = index

    def open(self) -> None:
        """Create it (0700) where it is not there. Raises OSError."""
        _private_dir(self.path.parent.parent)
        _private_dir(self.path.parent)
        _private_dir(self.path)

    def load(self) -> Saved | None:
        """The instance's manifest; None where there is none. Raises ValueError for one that
        is not a manifest (or not a plain file of this user)."""
        try:
            fd = os.open(self.path / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ValueError(f"its manifest cannot be read: {exc}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise ValueError("its manifest is not a file of this user")
            return Saved.decode(f.read(1 << 20))

    def store(self, saved: Saved | None) -> None:
        """Write the manifest whole and rename it into place (None: remove it)."""
        final = self.path / MANIFEST
        if saved is None:
            final.unlink(missing_ok=True)
            return
        tmp = self.path / f".{MANIFEST}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(saved.encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)

    def tidy(self, saved: Saved | None) -> int:
        """Remove every file here that ``saved`` does not name (a save cut short, a file of an
        earlier key); how many."""
        named = {MANIFEST} | {s.file for s in saved.slots} if saved is not None else {MANIFEST}
        removed = 0
        for entry in self.path.iterdir() if self.path.is_dir() else ():
            if entry.name not in named:
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
                removed += 1
        return removed

    def problem(self, s: SavedSlot) -> str | None:
        """Why slot file ``s`` may not be restored (not a plain file of this user, another
        size than recorded); None where it may."""
        try:
            st = (self.path / s.file).lstat()
        except OSError as exc:
            return f"its file is gone ({exc.strerror})"
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return "its file is not a plain file of this user"
        if st.st_size != s.bytes:
            return f"its file has {st.st_size} bytes, not the {s.bytes} saved"
        return None

    def place(self, tmp: str, final: str, size: int) -> None:
        """Make the engine's ``tmp`` file, of ``size`` bytes, the slot file ``final`` (0600).
        Raises OSError where it is not that file."""
        path = self.path / tmp
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise OSError(f"the engine wrote {st.st_size} bytes, not {size}")
        path.chmod(0o600)
        os.replace(path, self.path / final)

    def remove(self, *files: str) -> None:
        for name in files:
            (self.path / name).unlink(missing_ok=True)

    def held(self) -> int:
        """The bytes this instance's saved slots hold (0 without a readable record)."""
        try:
            saved = self.load()
        except ValueError:
            return 0
        return saved.size if saved is not None else 0

    def others(self) -> int:
        """The bytes the deployment's other instances hold in their saved slots."""
        total = 0
        for entry in self.deployment.iterdir() if self.deployment.is_dir() else ():
            if entry.name == str(self._index) or not entry.is_dir():
                continue
            try:
                total += Saved.decode((entry / MANIFEST).read_bytes()).size
            except (OSError, ValueError):
                continue
        return total
