"""``docs/architecture.md`` names every module of the gateway, and every name it gives in
backticks as a module path exists: a newcomer reading it finds each room, and no room it
names is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "capyctl_gateway"
DOC = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")


def _named(path: Path) -> bool:
    rel = path.relative_to(SRC)
    if rel.name == "__init__.py":
        return f"`{rel.parent.as_posix()}/`" in DOC or f"`{rel.parent.name}/" in DOC
    if len(rel.parts) == 1:
        return f"`{rel.name}`" in DOC
    # A module inside a room's package: named in the room's row as `name.py`.
    return f"`{rel.name}`" in DOC or f"`{rel.as_posix()}`" in DOC or f"{rel.as_posix()}" in DOC


def test_every_module_is_named() -> None:
    modules = [p for p in sorted(SRC.rglob("*.py")) if p != SRC / "__init__.py"]
    missing = [str(p.relative_to(SRC)) for p in modules if not _named(p)]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_every_module_path_it_names_exists() -> None:
    paths = set(re.findall(r"`(_[a-z_]+(?:/[a-z_]+)*(?:\.py|/))`", DOC))
    gone = []
    for name in sorted(paths):
        target = SRC / name.rstrip("/")
        if not target.exists():
            gone.append(name)
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"
