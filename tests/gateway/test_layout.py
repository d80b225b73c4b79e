"""The gateway's rooms import only what their docstrings allow, and stay small enough to read."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from capyctl_gateway._runners import KINDS

ROOT = Path(__file__).resolve().parents[2] / "src" / "capyctl_gateway"
RUNNER_ROOMS = {kind.open.__module__.split(".")[1] for kind in KINDS.values()}
"""The rooms of the kinds of runners, as their registry (``_runners.py``) names them: a new
kind's room is held to what the others are without a line here."""
# room -> the rooms of the gateway it must never import
FORBIDDEN = {
    "_errors": {"_http", "_relay", "_deployments", "_management", "_gateway", "_config", "cli"},
    "_engines": {"_http", "_relay", "_deployments", "_management", "_gateway", "_config", "cli"},
    "_relay": {"_http", "_deployments", "_management", "_gateway", "_lifecycle", "cli"},
    "_deployments": {"_http", "_relay", "_management", "_gateway", "_lifecycle", "cli"},
    # the policy room: where an engine runs is its runner's business (the seam), never asked
    "_lifecycle": {"_http", "_relay", "_management", "_gateway", "cli", *RUNNER_ROOMS, "_runners"},
    "_gateway": {"_http", "_relay", "_management", "cli"},
    "_fleet": {"_http", "_relay", "_management", "_gateway", "cli"},
    "_routing": {"_http", "_relay", "_management", "cli", "_workers", *RUNNER_ROOMS, "_runners"},
    "_tally": {"_http", "_management", "cli", "_workers", "_lifecycle", "_fleet", "_gateway"},
    "_http": {"_management", "cli"},
    # the Responses API over chat: the request's translation and the Response's making
    "_responses": {
        "_http",
        "_deployments",
        "_management",
        "_gateway",
        "_lifecycle",
        "cli",
        "_fleet",
        "_workers",
        *RUNNER_ROOMS,
        "_runners",
    },
    # Anthropic's Messages API over chat: the request's translation and the Message's making
    "_messages": {
        "_http",
        "_deployments",
        "_management",
        "_gateway",
        "_lifecycle",
        "cli",
        "_fleet",
        "_workers",
        *RUNNER_ROOMS,
        "_runners",
    },
    # when to switch: reads the lifecycle's states, never drives an engine or answers a client
    "_scheduling": {
        "_http",
        "_relay",
        "_management",
        "_gateway",
        "cli",
        "_fleet",
        "_workers",
        *RUNNER_ROOMS,
        "_runners",
    },
    "_management": {"cli"},
    "_machines": {
        "_http",
        "_management",
        "_lifecycle",
        "_gateway",
        "cli",
        "_local",
        "_pods",
        "_runners",
    },
    "_runners": {"_http", "_relay", "_management", "_gateway", "cli", "_lifecycle", "_fleet"},
    "_host": {"_http", "_management", "cli"},
    "_workers": {"_management", "_lifecycle", "_machines", "cli"},
}
# a runner room drives one kind of engine through the seam (what every kind needs is on the
# seam's side, ``_deployments``), never the policy, and never another kind's room
_RUNNER_ROOM_NEVER = {
    "_http", "_relay", "_management", "_gateway", "cli", "_lifecycle", "_fleet", "_runners",
    "_workers", "_host",
}  # fmt: skip
for _kind in RUNNER_ROOMS:
    FORBIDDEN[_kind] = FORBIDDEN.get(_kind, _RUNNER_ROOM_NEVER) | (RUNNER_ROOMS - {_kind})
_EVERY_ROOM = {
    "_http", "_relay", "_deployments", "_management", "_gateway", "_config", "_lifecycle",
    "_machines", "_host", "_routing", "_engines", "_errors", "_store", "_telemetry", "cli",
    "_fleet", "_workers", "_local", "_pods", "_runners", "_tasks", "_tally", "_responses",
    "_messages", "_scheduling",
}  # fmt: skip
for _leaf in ("_loop", "_ulid", "_log", "_events", "_engine_answer", "_engine_client", "_aiohttp"):
    FORBIDDEN[_leaf] = _EVERY_ROOM
FORBIDDEN["_tasks"] = _EVERY_ROOM - {"_errors"}  # the supervisor knows only the error tree


def _room(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


def _imported_modules(path: Path) -> set[str]:
    """The gateway modules ``path`` imports from, dotted from the package (``_local.runner``;
    ``from .. import _x`` names ``_x``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = path.relative_to(ROOT).parent.parts
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[: len(package) - (node.level - 1)])
            parts = [*base, *(node.module.split(".") if node.module else [])]
            if parts:
                found.add(".".join(parts))
            else:
                found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "capyctl_gateway."
        ):
            found.add(node.module.removeprefix("capyctl_gateway."))  # type: ignore[union-attr]
    return found


def _imported_rooms(path: Path) -> set[str]:
    return {module.split(".")[0] for module in _imported_modules(path)}


MODULES = sorted(p for p in ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_room_imports_only_what_it_may(path: Path) -> None:
    room = _room(path)
    bad = _imported_rooms(path) & FORBIDDEN.get(room, set())
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_workers_authority_imports_nothing_of_the_http_room() -> None:
    """The authority places and counts a worker's requests as one process does, through the
    placing and counting rooms, never through the public listener's."""
    path = ROOT / "_workers" / "authority.py"
    assert "_http" not in _imported_rooms(path)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_registry_opens_the_runner_rooms(path: Path) -> None:
    """Runners and their rooms are made by the registry alone: no other room imports them."""
    room = _room(path)
    if room in RUNNER_ROOMS or room == "_runners":
        return
    parts = [m.split(".") for m in _imported_modules(path)]
    bad = {".".join(p) for p in parts if p[0] in RUNNER_ROOMS and p[-1] in ("runner", "room")}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: only _runners.py may"


def _asks_a_kind(path: Path) -> list[str]:
    """What ``path`` asks of an engine's kind by name: a key of its description
    (``describe().get(...)``, ``describe()[...]``) or whether its deployment runs on pods."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        text = ast.unparse(node) if isinstance(node, ast.Call | ast.Subscript) else ""
        if re.search(r"describe\(\)(\.get\(|\[)", text):
            found.append(text)
        if isinstance(node, ast.Attribute) and node.attr == "on_pods":
            found.append(ast.unparse(node))
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_nobody_outside_a_runner_room_asks_its_kind(path: Path) -> None:
    """``status``, ``list``, the console and the lifecycle read a runner's typed description
    (`Described`) and its `Site`, never a kind's keys or whether it runs on pods (the
    configuration's own checks aside)."""
    if _room(path) in RUNNER_ROOMS or _room(path) == "_config":
        return
    assert not _asks_a_kind(path), (path.relative_to(ROOT), _asks_a_kind(path))


def _reads_a_runners_host_or_type(path: Path) -> list[int]:
    """Lines of ``path`` that read ``runner.host`` or test a runner's type."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "host"
            and isinstance(node.value, ast.Attribute | ast.Name)
            and getattr(node.value, "attr", getattr(node.value, "id", "")) == "runner"
        ):
            lines.append(node.lineno)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and "Runner" in ast.unparse(node.args[1])
        ):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_nobody_asks_a_runner_where_it_runs(path: Path) -> None:
    """Outside the runner rooms, where an engine runs is read from its `Site` alone."""
    if _room(path) in RUNNER_ROOMS:
        return
    assert not _reads_a_runners_host_or_type(path), path.relative_to(ROOT)


WIRING = {"runner", "holdup", "api"}
"""What issue 43 found set after construction (an instance's runner, a queue's holdup, a
cluster's API): each object is built whole, so these are set by their own object as it is
made, never afterwards and never from outside."""


def _wired_after_construction(path: Path) -> list[str]:
    """Assignments in ``path`` to one of `WIRING` other than ``self.<name>`` directly in an
    ``__init__`` or ``__post_init__`` (a function nested in one is not it)."""
    found: list[str] = []

    def visit(node: ast.AST, built: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, getattr(child, "name", "") in ("__init__", "__post_init__"))
                continue
            if isinstance(child, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                for target in (t for tg in targets for t in ast.walk(tg)):
                    if isinstance(target, ast.Attribute) and target.attr in WIRING:
                        own = isinstance(target.value, ast.Name) and target.value.id == "self"
                        if not (built and own):
                            found.append(f"{child.lineno}: {ast.unparse(target)}")
            visit(child, built)

    visit(ast.parse(path.read_text(encoding="utf-8")), built=False)
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_wiring_is_set_as_its_object_is_built(path: Path) -> None:
    assert not _wired_after_construction(path), (
        path.relative_to(ROOT),
        _wired_after_construction(path),
    )


def test_the_wiring_check_finds_a_late_assignment(tmp_path: Path) -> None:
    """The check above, on the kind of code it was written against (``attach``, e7050c8 to
    a87e141)."""
    late = tmp_path / "late.py"
    late.write_text(
        "class I:\n"
        "    def __init__(self):\n        self.runner = None\n"
        "    def attach(self, r):\n        self.runner = r\n"
        "def build(q, h):\n    q.holdup = h\n",
        encoding="utf-8",
    )
    assert _wired_after_construction(late) == ["5: self.runner", "7: q.holdup"]


MAX_MODULE_LINES = 300
MAX_CLASS_LINES = 120
# "module:Class" -> its own cap, for the classes that run once per engine read: their per-read
# code stays in one class (no attribute hop or call more per chunk), and the cap (their size
# when the table was made, rounded up to 5) keeps them from growing.
HOT_PATH_CLASSES = {
    # decodes and verifies each engine read in one pass: a helper object is one more hop per read
    "_relay/blocks.py:BlockReader": 150,
    # checks each chunk against the rules inline (its chunk-level fields too): splitting adds
    # an attribute hop per chunk
    "_relay/verify.py:ChunkVerifier": 160,
    # moves the deadline on every relayed chunk: a second object is one more hop per chunk
    # (150 since a worker's exchange says when output starts, for its settlement)
    "_relay/exchange.py:Exchange": 150,
}
# "module:Class" -> its own cap, for a class that is one concept: its methods belong together,
# and moving some into free functions beside it (to keep under the bound) would split by line
# count, not along a seam. The cap is its size when it was listed, rounded up to 5.
ONE_CONCEPT_CLASSES = {
    # the seam's every member for an engine on this machine, each a line or two over helpers
    "_local/runner.py:LocalRunner": 135,
    # the same for an engine on a host, with the reports it takes, their age (fresh, stale) and
    # what status shows of them (the engine's cache counts among them)
    "_machines/runner.py:HostRunner": 165,
    # the same for a pod: a start creates it, waits on the watch and asks the engine itself;
    # a previous run's pod taken up; one run's pod and its deletion are `PodRun`'s
    "_pods/runner.py:PodRunner": 175,
    # one deployment's admission: its running slots, its line of waiters, its gate and its idle
    # clock (what the scheduler reads of it), each touched on every request
    "_deployments/queue.py:DeploymentQueue": 150,
    # every launched deployment's state, its activations (one per wave) and closings
    "_lifecycle/controller.py:Lifecycle": 175,
    # cut requests: recording, the evidence of each collector event (a restart proven among
    # it, which a host's report also hears of), settling
    "_deployments/settle.py:Settlement": 135,
    # one engine connection: its protocol callbacks, its answer, its reuse or its end
    "_engine_client.py:_Connection": 130,
    # one engine's bounded log: writing, rotating, reading its tail back
    "_local/enginelog.py:EngineLog": 135,
}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_and_classes_stay_readable(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    assert lines <= MAX_MODULE_LINES, f"split the module ({lines} lines)"
    rel = path.relative_to(ROOT).as_posix()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            key = f"{rel}:{node.name}"
            cap = HOT_PATH_CLASSES.get(key) or ONE_CONCEPT_CLASSES.get(key, MAX_CLASS_LINES)
            assert size <= cap, f"class {node.name} is {size} lines (at most {cap})"


def test_hot_path_exceptions_name_classes_that_exist() -> None:
    for entry in [*HOT_PATH_CLASSES, *ONE_CONCEPT_CLASSES]:
        module, name = entry.split(":")
        tree = ast.parse((ROOT / module).read_text(encoding="utf-8"))
        assert any(isinstance(n, ast.ClassDef) and n.name == name for n in ast.walk(tree)), entry


_FMT_SKIP = re.compile(r"#.*\bfmt:\s*skip\b")
_TABLES = (ast.Tuple, ast.List, ast.Dict, ast.Set)


def _is_table(stmt: ast.stmt) -> bool:
    """A module's or a class's literal table: a tuple, list, dict or set display (or a
    frozenset of one) assigned to a name, laid out by hand in rows."""
    value = stmt.value if isinstance(stmt, ast.Assign | ast.AnnAssign) else None
    if (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "frozenset"
        and len(value.args) == 1
        and not value.keywords
    ):
        value = value.args[0]
    return isinstance(value, _TABLES)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_fmt_skip_only_on_tables(path: Path) -> None:
    """``# fmt: skip`` keeps a table in its rows; everything else is as ``ruff format`` has it."""
    text = path.read_text(encoding="utf-8")
    lines = [
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT and _FMT_SKIP.search(tok.string)
    ]
    if not lines:
        return
    tree = ast.parse(text)
    # statements of the module and of its classes: a literal built inside a function is a
    # value, not a table
    scopes: list[ast.Module | ast.ClassDef] = [tree]
    scopes += [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    ends = {stmt.end_lineno: stmt for scope in scopes for stmt in scope.body}
    for line in lines:
        stmt = ends.get(line)
        assert stmt is not None and _is_table(stmt), (
            f"line {line}: `# fmt: skip` on something other than a module's or a class's "
            "literal table: remove it and run `ruff format`"
        )


def test_every_room_says_what_it_owns() -> None:
    for package in (
        "_http",
        "_relay",
        "_deployments",
        "_lifecycle",
        "_management",
        "_machines",
        "_responses",
        "_messages",
    ):
        doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
        assert doc and "never" in doc, package
