"""The gateway's rooms import only what their docstrings allow, and stay small enough to read."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "src" / "capyctl_gateway"
# room -> the rooms of the gateway it must never import
FORBIDDEN = {
    "_errors": {"_http", "_relay", "_deployments", "_management", "_gateway", "_config", "cli"},
    "_engines": {"_http", "_relay", "_deployments", "_management", "_gateway", "_config", "cli"},
    "_relay": {"_http", "_deployments", "_management", "_gateway", "_lifecycle", "cli"},
    "_deployments": {"_http", "_relay", "_management", "_gateway", "_lifecycle", "cli"},
    "_lifecycle": {"_http", "_relay", "_management", "_gateway", "cli"},
    "_gateway": {"_http", "_relay", "_management", "cli"},
    "_routing": {"_http", "_relay", "_management", "cli"},
    "_http": {"_management", "cli"},
    "_management": {"cli"},
    "_machines": {"_http", "_management", "_lifecycle", "_gateway", "cli"},
    "_host": {"_http", "_management", "cli"},
}
_EVERY_ROOM = {
    "_http", "_relay", "_deployments", "_management", "_gateway", "_config", "_lifecycle",
    "_machines", "_host", "_routing", "_engines", "_errors", "_store", "_telemetry", "cli",
}  # fmt: skip
for _leaf in ("_loop", "_ulid", "_log", "_engine_answer", "_engine_client", "_aiohttp"):
    FORBIDDEN[_leaf] = _EVERY_ROOM


def _room(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


def _imported_rooms(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = path.relative_to(ROOT).parent.parts
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[: len(package) - (node.level - 1)])
            parts = [*base, *(node.module.split(".") if node.module else [])]
            if parts:
                found.add(parts[0])
            else:
                found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "capyctl_gateway."
        ):
            found.add(node.module.split(".")[1])  # type: ignore[union-attr]
    return found


MODULES = sorted(p for p in ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_room_imports_only_what_it_may(path: Path) -> None:
    room = _room(path)
    bad = _imported_rooms(path) & FORBIDDEN.get(room, set())
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_and_classes_stay_readable(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 360, "split the module"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            assert size <= 160, f"class {node.name} is {size} lines"


def test_every_room_says_what_it_owns() -> None:
    for package in ("_http", "_relay", "_deployments", "_lifecycle", "_management", "_machines"):
        doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
        assert doc and "never" in doc, package
