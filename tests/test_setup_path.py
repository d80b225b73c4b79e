"""``scripts/link-commands`` (run by ``scripts/setup``): the guide's ``capyctl ...`` works as
typed in a new shell after the quick start (issue 34), without taking a file that is not ours.

Each test runs the real script under real bash with ``HOME`` and ``PATH`` pointed at a fresh
directory, then asks new login and interactive shells where ``capyctl`` is."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tomllib
from pathlib import Path

import pytest
from contract.demo import BIN, new_shell_hint, program

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "link-commands"
VENV_BIN = ROOT / ".venv" / "bin"
BASE_PATH = "/usr/bin:/bin"
with (ROOT / "pyproject.toml").open("rb") as f:
    COMMANDS = tuple(tomllib.load(f)["project"]["scripts"])


def link_commands(home: Path, **env: str) -> str:
    """Run the script as setup does, in an environment of only ``env``; its output."""
    done = subprocess.run(
        ["bash", str(SCRIPT)],
        env={"HOME": str(home), "PATH": BASE_PATH, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert done.stderr == ""
    return done.stdout


def new_shell(home: Path, flag: str, command: str) -> str:
    """``command``'s output in a new ``bash -l`` (reads ~/.profile), ``bash -i`` (~/.bashrc) or
    plain ``bash`` (``flag`` ``""``: reads neither)."""
    done = subprocess.run(
        ["bash", (flag or "-") + "c", command],
        env={"HOME": str(home), "PATH": BASE_PATH, "TERM": "dumb"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.stdout.strip()


def contents(home: Path) -> dict[str, str]:
    """Every file (its text) and link (its target) under ``home``."""
    found = {}
    for path in sorted(home.rglob("*")):
        if path.is_symlink():
            found[str(path)] = "-> " + os.readlink(path)
        elif path.is_file():
            found[str(path)] = path.read_text()
    return found


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    return home


def test_it_links_every_command_of_the_project() -> None:
    assert set(COMMANDS) == {"capyctl", "capyctl-gateway", "canopyx-provider"}
    for name in COMMANDS:
        assert os.access(VENV_BIN / name, os.X_OK), f"{name}: run scripts/setup first"


def test_a_new_shell_finds_capyctl_after_setup(home: Path) -> None:
    said = link_commands(home)

    bin_dir = home / ".local" / "bin"
    for name in COMMANDS:
        assert (bin_dir / name).is_symlink()
        assert (bin_dir / name).resolve() == (VENV_BIN / name).resolve()
    assert said.count("\n") == 1
    assert said.startswith("setup: linked ") and "into ~/.local/bin and put it on PATH" in said
    assert "~/.profile, ~/.bashrc: a new shell finds them" in said
    assert "CANOPYX_NO_MODIFY_PATH=1" in said
    assert not (home / ".zshrc").exists()  # only where it exists already
    for flag in ("-l", "-i"):
        assert new_shell(home, flag, "command -v capyctl") == str(bin_dir / "capyctl")
    version = new_shell(home, "-l", "capyctl --version")
    assert version and version == new_shell(home, "-i", "capyctl-gateway --version")
    # The line the script names for this shell works too (a shell that reads neither file).
    assert new_shell(home, "", "command -v canopyx-provider") == ""
    env_line = said.split("(this one: ", 1)[1].split(";", 1)[0]
    assert new_shell(home, "", f"{env_line}; command -v canopyx-provider") == str(
        bin_dir / "canopyx-provider"
    )


def test_a_rerun_changes_nothing_and_says_nothing(home: Path) -> None:
    link_commands(home)
    before = contents(home)

    assert link_commands(home) == ""
    assert contents(home) == before
    profile = (home / ".profile").read_text()
    assert profile.count("canopyx") == 2  # the comment and the line, once
    assert profile.startswith("# canopyx (scripts/setup)")  # a new file gets no blank line


def test_a_file_of_the_same_name_that_is_not_ours_is_left_alone(home: Path) -> None:
    bin_dir = home / ".local" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "capyctl").write_text("#!/bin/sh\necho mine\n")
    (bin_dir / "capyctl-gateway").symlink_to("/usr/bin/true")
    # A link into a checkout removed since is ours: it is pointed at this one.
    (bin_dir / "canopyx-provider").symlink_to("/gone/canopyx/.venv/bin/canopyx-provider")

    said = link_commands(home)

    assert (bin_dir / "capyctl").read_text() == "#!/bin/sh\necho mine\n"
    assert os.readlink(bin_dir / "capyctl-gateway") == "/usr/bin/true"
    assert os.readlink(bin_dir / "canopyx-provider") == str(VENV_BIN / "canopyx-provider")
    lines = said.splitlines()
    assert lines[0].startswith("setup: left ~/.local/bin/capyctl-gateway alone")
    assert lines[1] == (
        "setup: left ~/.local/bin/capyctl alone (not a link of this project's); "
        f"this checkout's capyctl is {VENV_BIN}/capyctl"
    )
    assert lines[2].startswith("setup: linked canopyx-provider into ~/.local/bin and put")
    assert len(lines) == 3
    assert link_commands(home) == "\n".join(lines[:2]) + "\n"  # the foreign ones, every time


def test_the_opt_outs(home: Path) -> None:
    assert link_commands(home, CANOPYX_NO_LINK="1") == ""
    assert contents(home) == {}

    said = link_commands(home, CANOPYX_NO_MODIFY_PATH="1")

    assert said == (
        "setup: linked canopyx-provider, capyctl-gateway, capyctl into ~/.local/bin "
        "(not on PATH: add it, or run ~/.local/bin/canopyx-provider)\n"
    )
    assert sorted(contents(home)) == sorted(str(home / ".local/bin" / n) for n in COMMANDS)
    assert new_shell(home, "-i", "command -v capyctl") == ""


def test_a_directory_already_on_path_leaves_the_startup_files_alone(home: Path) -> None:
    bin_dir = home / ".local" / "bin"
    said = link_commands(home, PATH=f"{bin_dir}:{BASE_PATH}")

    assert said.endswith(" into ~/.local/bin (on PATH)\n")
    assert not (home / ".profile").exists() and not (home / ".bashrc").exists()


def test_xdg_bin_home_and_the_startup_files_bash_and_zsh_read(home: Path) -> None:
    bin_dir = home / "bin"
    for rc in (".bash_profile", ".zshrc"):  # bash -l reads .bash_profile, not .profile
        (home / rc).write_text("export EDITOR=vi\n")

    said = link_commands(home, XDG_BIN_HOME=str(bin_dir))

    assert "into ~/bin and put it on PATH in ~/.profile, ~/.bashrc, ~/.bash_profile, ~/.zshrc" in (
        said
    )
    assert (home / ".zshrc").read_text().startswith("export EDITOR=vi\n\n# canopyx")
    assert new_shell(home, "-l", "command -v capyctl") == str(bin_dir / "capyctl")
    assert not (home / ".local" / "bin").exists()


def test_setup_runs_it(home: Path) -> None:
    stamp = ROOT / ".venv" / ".canopyx-setup"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    if not stamp.is_file() or stamp.read_text().strip() != want:
        pytest.fail(".venv is older than pyproject.toml: run scripts/setup first")
    env = {"HOME": str(home), "PATH": BASE_PATH}
    setup = [str(ROOT / "scripts" / "setup")]
    done = subprocess.run(setup, env=env, capture_output=True, text=True, check=True, timeout=30)

    assert done.stdout.startswith("setup: linked ") and done.stderr == ""
    assert new_shell(home, "-i", "command -v capyctl") == str(home / ".local/bin/capyctl")
    assert subprocess.run(setup, env=env, capture_output=True, check=True, timeout=30).stdout == b""


def test_the_demo_prints_capyctl_by_name_where_path_finds_this_checkouts(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = home / ".local" / "bin"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_BIN_HOME", raising=False)
    monkeypatch.delenv("CANOPYX_NO_MODIFY_PATH", raising=False)
    monkeypatch.setenv("PATH", BASE_PATH)
    assert program("capyctl") == str(BIN / "capyctl")  # works from any directory
    assert new_shell_hint("capyctl") is None  # nothing linked: nothing to promise

    link_commands(home)

    assert program("capyctl") == str(BIN / "capyctl")  # this shell's PATH still lacks it
    assert new_shell_hint("capyctl") == (
        f"(a new shell finds capyctl by name: scripts/setup linked it into {bin_dir})"
    )
    monkeypatch.setenv("CANOPYX_NO_MODIFY_PATH", "1")
    assert new_shell_hint("capyctl") is None
    monkeypatch.setenv("PATH", f"{bin_dir}:{BASE_PATH}")  # as in a new shell
    assert program("capyctl") == "capyctl"
    assert program("canopyx-provider") == "canopyx-provider"
    # A capyctl earlier on PATH that is not this checkout's: the path, so that ours runs.
    other = home / "other"
    other.mkdir()
    (other / "capyctl").write_text("#!/bin/sh\n")
    (other / "capyctl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{other}:{bin_dir}:{BASE_PATH}")
    assert program("capyctl") == str(BIN / "capyctl")
