"""The llama.cpp build's time left, replayed from a measured build: ninja's status lines as a
build on two cores prints them (each line says one step ended), fed to the progress line's
estimate at the times they come, against the time the build really had left."""

from __future__ import annotations

import heapq
import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from contract.engines._pace import StepTimes, TimeLeft
from contract.engines._progress import parse_build_line
from contract.engines.llamacpp import BUILD_MINUTES, BUILD_NOTE, STEP_TIMES, step_times

README = Path(__file__).resolve().parents[2] / "README.md"


def _steps() -> list[tuple[float, str]]:
    """The measured build's steps in the order ninja ran them: seconds, the output it names."""
    steps = []
    for line in STEP_TIMES.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            ms, _, outputs = line.partition("\t")
            steps.append((int(ms) / 1000, outputs.split()[-1]))
    return steps


def _replay(slower: Callable[[int], float], jobs: int = 2) -> list[tuple[float, str]]:
    """The status lines of a build whose step ``i`` takes its measured time times
    ``slower(i)``, ``jobs`` at a time in the measured order: when each is printed, and it."""
    free = [0.0] * jobs
    ended = []
    for i, (seconds, output) in enumerate(_steps()):
        start = heapq.heappop(free)
        end = start + seconds * slower(i)
        heapq.heappush(free, end)
        ended.append((end, output))
    ended.sort()
    total = len(ended)
    return [
        (t, f"  [{n}/{total}] Building CXX object {output}")
        for n, (t, output) in enumerate(ended, 1)
    ]


def _worst_error(lines: list[tuple[float, str]], times: StepTimes | None) -> float:
    """The largest error of the estimate shown, as a share of the time really left (counted
    while more than two minutes are left: below that the line says about 1 or 2 min)."""
    left = TimeLeft(times=times)
    end = lines[-1][0]
    worst = 0.0
    for t, line in lines:
        stage = parse_build_line(line)
        assert stage is not None
        left.observe(stage, t)
        said = left.seconds(t)
        if said is not None and end - t > 120:
            worst = max(worst, abs(said - (end - t)) / (end - t))
    return worst


def test_the_measured_build_is_every_step_the_status_lines_name() -> None:
    times = step_times()
    lines = _replay(lambda _: 1.0)
    assert times.count == len(lines) == 336
    assert 9 * 60 < lines[-1][0] < 10 * 60  # 9 min 38 s of compiling on two cores
    named = [parse_build_line(line) for _, line in lines]
    assert all(s is not None and s.unit in times for s in named)


@pytest.mark.parametrize(
    ("how", "slower"),
    [
        ("as measured", lambda _: 1.0),
        ("twice as slow", lambda _: 2.0),
        ("each step 0.6-1.6 times its time", lambda i: random.Random(i).uniform(0.6, 1.6)),
        ("the C++ half slower", lambda i: 1.0 if i < 200 else 1.5),
    ],
)
def test_the_time_left_weighs_each_step_by_its_measured_time(
    how: str, slower: Callable[[int], float]
) -> None:
    """By a count of steps, the estimate said "about 2 min left" with six to go, and up to
    twice too long early on: the first 200 steps are small C files, the last the heavy C++.
    Weighed by what each step took, it is within a third of the truth wherever it is shown
    (on a machine whose load changes halfway, within the change)."""
    lines = _replay(slower)
    by_count = _worst_error(lines, None)
    by_weight = _worst_error(lines, step_times())
    assert by_count > 0.5, by_count  # how wrong the count was on the same build
    assert by_weight < (0.4 if how == "the C++ half slower" else 0.3), (how, by_weight)


def test_the_first_build_is_announced_with_the_measured_range() -> None:
    """ "several minutes" was 20 on a busy machine: the opening line and the README's quick
    start say the range measured on two cores (5 idle, 10 and 20 with other work on them)."""
    low, high = BUILD_MINUTES
    assert f"{low}–{high} min on 2 cores" in BUILD_NOTE
    demo = next(
        line
        for line in README.read_text(encoding="utf-8").splitlines()
        if line.startswith("scripts/demo ")
    )
    assert f"{low}–{high} minutes on 2 cores" in demo, demo
    assert re.search(r"several minutes", BUILD_NOTE + demo) is None
