"""The gateway's house figures: largest module, longest function, largest class, exception
roots, branches on where an engine runs, writers of an instance's availability.

``python -m bench.house_figures [SRC]`` prints them (default ``src/capyctl_gateway``); the
fleet issue's closing note quotes them before and after.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path


def _exception_roots(trees: dict[Path, ast.Module]) -> list[str]:
    """Classes deriving directly from a builtin exception (Exception, RuntimeError, ...)."""
    builtin = {n for n in dir(__builtins__) if n.endswith(("Error", "Exception"))}
    roots = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                if bases & builtin:
                    roots.append(f"{path.name}:{node.name}")
    return sorted(roots)


def main(src: str = "src/capyctl_gateway") -> None:
    root = Path(src)
    trees = {p: ast.parse(p.read_text(encoding="utf-8")) for p in sorted(root.rglob("*.py"))}
    modules = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in trees}
    big = max(modules, key=lambda p: modules[p])
    funcs: list[tuple[int, str]] = []
    classes: list[tuple[int, str]] = []
    for p, tree in trees.items():
        for node in ast.walk(tree):
            size = (getattr(node, "end_lineno", 0) or 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                funcs.append((size, f"{p.relative_to(root)}:{node.name}"))
            elif isinstance(node, ast.ClassDef):
                classes.append((size, f"{p.relative_to(root)}:{node.name}"))
    text = {p: p.read_text(encoding="utf-8") for p in trees}
    remote = sum(len(re.findall(r"\.remote\b", t)) for t in text.values())
    remote_files = sum(1 for t in text.values() if re.search(r"\.remote\b", t))
    writes = [
        f"{p.relative_to(root)}:{n}"
        for p, t in text.items()
        for n, line in enumerate(t.splitlines(), 1)
        if re.search(r"\.available\s*=(?!=)", line)
    ]
    skips = sum(t.count("# fmt: skip") for t in text.values())
    roots = _exception_roots(trees)
    print(f"largest module: {big.relative_to(root)} ({modules[big]} lines)")
    (fsize, fname), (csize, cname) = max(funcs), max(classes)
    print(f"longest function: {fname} ({fsize} lines)")
    print(f"largest class: {cname} ({csize} lines)")
    print(f"exception roots ({len(roots)}): {', '.join(roots)}")
    print(f"branches on .remote: {remote} in {remote_files} modules")
    print(f"writers of .available: {len(writes)} ({', '.join(writes)})")
    print(f"# fmt: skip lines: {skips}")


if __name__ == "__main__":
    main(*sys.argv[1:])
