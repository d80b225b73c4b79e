"""Each CLI's doc page matches its commands, so that the docs cannot drift again (issue 15).

The commands and their options come from click's model of the typer apps
(``typer.main.get_command``), never from help text. On the doc page:

* **Synopsis.** In an untagged fenced block, a line that starts with the program's name (and the
  indented lines after it) is a command's synopsis. Each command with options has exactly one,
  and it names exactly the command's options: every option in ``--help`` is documented, and no
  documented option is made up.
* **Sections.** Every ``--option`` in backticks in the section (the text under one heading) that
  holds a command's synopsis belongs to that command; one in the page's shared section belongs to
  every command. On a page about the CLI alone (``strict``), every ``--option`` named anywhere
  belongs to some command (the gateway's page also names engines' flags, so it is not strict).
* **Examples.** A line of a ``bash`` or ``console`` block that runs the program uses real options.
* **Defaults.** A table row ``| `--option ...` | `value` | ...`` in a command's section shows the
  default the command really has.

A failure lists every disagreement, one sentence each, naming the command and the option.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import pytest
import typer
import typer.core
import typer.main

from canopyx_provider.cli import app as provider_app
from capyctl_gateway.cli import app as gateway_app

ROOT = Path(__file__).resolve().parent.parent
#: typer's own options on every app: not the project's to document.
BUILTIN = frozenset({"--help", "--install-completion", "--show-completion"})
_OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
_BACKTICKED = re.compile(r"`([^`]+)`")
_DEFAULT_ROW = re.compile(r"^\|\s*`(--[a-z][a-z0-9-]*)[^`]*`\s*\|\s*`([^`]*)`")
_EXAMPLE_TAGS = frozenset({"bash", "console", "sh", "shell"})

Command = typer.core.TyperCommand | typer.core.TyperGroup
Path_ = tuple[str, ...]


@dataclass(frozen=True)
class Page:
    name: str
    prog: str
    app: typer.Typer
    doc: Path
    shared_section: str | None = None
    strict: bool = False


PAGES = (
    Page(
        "provider",
        "canopyx-provider",
        provider_app,
        ROOT / "docs" / "provider" / "cli.md",
        shared_section="Options every command takes",
        strict=True,
    ),
    Page("gateway", "capyctl-gateway", gateway_app, ROOT / "docs" / "gateway" / "README.md"),
)

# --------------------------------------------------------------------------- the commands


def commands(page: Page) -> dict[Path_, Command]:
    """Every command of the app by its path (the app itself is ``()``), groups included."""
    root = typer.main.get_command(page.app)
    assert isinstance(root, typer.core.TyperGroup | typer.core.TyperCommand)
    found: dict[Path_, Command] = {}

    def walk(cmd: Command, path: Path_) -> None:
        found[path] = cmd
        if isinstance(cmd, typer.core.TyperGroup):
            for name, sub in cmd.commands.items():
                assert isinstance(sub, typer.core.TyperGroup | typer.core.TyperCommand)
                walk(sub, (*path, name))

    walk(root, ())
    return found


def options(cmd: Command) -> dict[str, typer.core.TyperOption]:
    """The command's options by flag (``--x`` and any ``--no-x``), typer's own left out."""
    found: dict[str, typer.core.TyperOption] = {}
    for param in cmd.params:
        if isinstance(param, typer.core.TyperOption):
            for flag in (*param.opts, *param.secondary_opts):
                if flag not in BUILTIN:
                    found[flag] = param
    return found


def needs_synopsis(cmd: Command) -> bool:
    """Leaf commands always; the app and groups only when they have options of their own."""
    return not isinstance(cmd, typer.core.TyperGroup) or bool(options(cmd))


def label(page: Page, path: Path_) -> str:
    return " ".join((page.prog, *path))


# --------------------------------------------------------------------------- the page


@dataclass
class Section:
    heading: str
    synopses: list[tuple[Path_, set[str]]] = field(default_factory=list)
    named: list[str] = field(default_factory=list)
    """``--options`` in backticks, in order."""
    examples: list[tuple[Path_, set[str], str]] = field(default_factory=list)
    defaults: list[tuple[str, str]] = field(default_factory=list)
    """(option, documented default) from table rows."""


def _path_of(words: list[str], cmds: Mapping[Path_, Command]) -> Path_:
    """The command path a command line starts with (its words after the program's name)."""
    path: Path_ = ()
    for word in words:
        if (*path, word) not in cmds:
            break
        path = (*path, word)
    return path


def read_page(page: Page, cmds: Mapping[Path_, Command]) -> list[Section]:
    sections = [Section("")]
    fence: str | None = None  # the open fence's tag ("" when untagged)
    synopsis: list[str] | None = None

    def end_synopsis() -> None:
        nonlocal synopsis
        if synopsis is not None:
            words = " ".join(synopsis).split()[1:]
            sections[-1].synopses.append(
                (_path_of(words, cmds), set(_OPTION.findall(" ".join(synopsis))))
            )
            synopsis = None

    for line in page.doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            end_synopsis()
            fence = None if fence is not None else line[3:].strip()
            continue
        if fence is None:
            if m := re.match(r"^#+\s+(.*)$", line):
                sections.append(Section(m[1].strip()))
                continue
            for span in _BACKTICKED.findall(line):
                sections[-1].named.extend(_OPTION.findall(span))
            if m := _DEFAULT_ROW.match(line):
                sections[-1].defaults.append((m[1], m[2]))
            continue
        if fence == "":
            if synopsis is not None and line[:1].isspace() and line.strip():
                synopsis.append(line.strip())
                continue
            end_synopsis()
            if line == page.prog or line.startswith(page.prog + " "):
                synopsis = [line]
        elif fence in _EXAMPLE_TAGS:
            text = line.removeprefix("$ ")
            if text.startswith(page.prog + " "):
                words = text.split()[1:]
                sections[-1].examples.append(
                    (_path_of(words, cmds), set(_OPTION.findall(text)), line)
                )
    end_synopsis()
    return sections


# --------------------------------------------------------------------------- the checks


def _same_default(documented: str, default: object) -> bool:
    if isinstance(default, Enum):
        default = default.value
    if isinstance(default, float) and not isinstance(default, bool):
        try:
            return float(documented) == default
        except ValueError:
            return False
    return documented == str(default)


def check_page(page: Page) -> list[str]:
    """Every way the page and the commands disagree, one sentence each."""
    cmds = commands(page)
    sections = read_page(page, cmds)
    return [*_synopsis_problems(page, cmds, sections), *_section_problems(page, cmds, sections)]


def _synopsis_problems(
    page: Page, cmds: Mapping[Path_, Command], sections: list[Section]
) -> Iterator[str]:
    synopses: dict[Path_, list[set[str]]] = {}
    for section in sections:
        for path, named in section.synopses:
            synopses.setdefault(path, []).append(named)
    for path, cmd in cmds.items():
        found = synopses.get(path, [])
        if not found:
            if needs_synopsis(cmd):
                yield f"{label(page, path)}: no synopsis on {page.doc.name}"
            continue
        if len(found) > 1:
            yield f"{label(page, path)}: {len(found)} synopses, expected one"
        named = set().union(*found)
        real = set(options(cmd))
        for flag in sorted(real - named):
            yield f"{label(page, path)}: {flag} is in --help but not in its synopsis"
        for flag in sorted(named - real):
            yield f"{label(page, path)}: its synopsis names {flag}, which does not exist"


def _section_problems(
    page: Page, cmds: Mapping[Path_, Command], sections: list[Section]
) -> Iterator[str]:
    opts = {path: options(cmd) for path, cmd in cmds.items()}
    leaves = [p for p, c in cmds.items() if not isinstance(c, typer.core.TyperGroup)]
    every_option = set().union(*opts.values())
    for section in sections:
        owners = [path for path, _ in section.synopses]
        where = f"named under {section.heading!r}"
        for flag in section.named:
            if section.heading == page.shared_section:
                for path in leaves:
                    if flag not in opts[path]:
                        yield f"{label(page, path)}: lacks {flag}, {where}"
            elif owners and not any(flag in opts[p] for p in owners):
                who = ", ".join(label(page, p) for p in owners)
                yield f"{who}: {flag} is {where} but does not exist"
            elif not owners and page.strict and flag not in every_option:
                yield f"{page.prog}: {flag} is {where} but does not exist"
        for path, named, line in section.examples:
            for flag in sorted(named - set(opts[path])):
                yield f"{label(page, path)}: the example {line!r} uses {flag}, which does not exist"
        if len(owners) == 1:
            for flag, documented in section.defaults:
                param = opts[owners[0]].get(flag)
                if param is None or param.is_flag or param.default is None:
                    continue
                if not _same_default(documented, param.default):
                    yield (
                        f"{label(page, owners[0])}: {flag} defaults to {param.default!r}, "
                        f"the page says {documented!r}"
                    )


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_the_doc_page_matches_the_commands(page: Page) -> None:
    problems = check_page(page)
    assert not problems, f"{page.doc.relative_to(ROOT)} and the CLI disagree:\n" + "\n".join(
        problems
    )


def test_the_checks_catch_drift(tmp_path: Path) -> None:
    """The rules find what issue 15 found: an option documented for the wrong command, one
    missing from a synopsis, a wrong default."""
    doc = tmp_path / "cli.md"
    doc.write_text(
        "# canopyx-provider\n\n```\ncanopyx-provider --version\n```\n\n"
        "## Options every command takes\n\n| `--engine E` | x |\n\n"
        "## check\n\n```\ncanopyx-provider check --engine E --base-url U --model M\n"
        "    [--poll-interval-ms MS]\n```\n\n"
        "| option | default | meaning |\n|---|---|---|\n| `--request-timeout-ms MS` | `2000` | x |\n\n"
        "```bash\ncanopyx-provider check --engine vllm --nope\n```\n",
        encoding="utf-8",
    )
    page = Page("t", "canopyx-provider", provider_app, doc, "Options every command takes", True)
    problems = check_page(page)
    assert "canopyx-provider check: --json is in --help but not in its synopsis" in problems
    assert (
        "canopyx-provider check: its synopsis names --poll-interval-ms, which does not exist"
        in problems
    )
    assert (
        "canopyx-provider check: --request-timeout-ms defaults to 3000, the page says '2000'"
        in problems
    )
    assert any("uses --nope" in p for p in problems)
    assert "canopyx-provider watch: no synopsis on cli.md" in problems


def test_the_checks_catch_the_gateway_gap_issue_15_found(tmp_path: Path) -> None:
    """docs/gateway/README.md before d520b3f: ``serve``'s synopsis without ``--management``."""
    doc = tmp_path / "README.md"
    doc.write_text(
        "# capyctl-gateway\n\n## Running it\n\n```\n"
        "capyctl-gateway serve --config FILE [--listen HOST:PORT] [--state-dir DIR]"
        " [--log-format text|json]\ncapyctl-gateway --version\n```\n\n"
        "## status deployment\n\n```\ncapyctl-gateway status deployment my-model [--json]"
        " [--state-dir DIR] [--management HOST:PORT]\n```\n",
        encoding="utf-8",
    )
    problems = check_page(Page("t", "capyctl-gateway", gateway_app, doc))
    about = [p for p in problems if "--management" in p]
    assert about == ["capyctl-gateway serve: --management is in --help but not in its synopsis"]
