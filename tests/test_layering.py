"""Who may import whom (docs/architecture.md): every package-relative import in
src/mambakit, lazy ones inside functions included, goes to a part of the package at the
same rank or below. An AST walk of the source: no import runs."""

from __future__ import annotations

import ast
from pathlib import Path

import mambakit

ROOT = Path(mambakit.__file__).parent
# the parts of the package, lowest first; a part imports only from its own rank or below
RANKS = {
    "config": 0, "cuda_graphs": 0, "files": 0, "targets": 0, "text": 0, "threads": 0, "state": 0,
    "ops": 1,
    "layers": 2,
    "hf": 3, "inference": 3,
    "backbone": 4, "model": 4,
    "training": 5, "tasks": 5, "serve": 5,
    "cli": 6, "__init__": 6, "__main__": 6,
}  # fmt: skip


def part(module: str) -> str:
    """The top-level part of a dotted module name under mambakit ("ops", "model", ...)."""
    return module.split(".")[0]


def imports(path: Path) -> list[tuple[str, int]]:
    """(the imported module as a dotted name under mambakit, line) of each relative or
    absolute mambakit import in `path`."""
    here = path.relative_to(ROOT).with_suffix("").parts
    package = here[:-1] if here[-1] != "__init__" else here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                name = ".".join((*base, node.module)) if node.module else ".".join(base)
                if not name:  # `from . import x` at the top: x is the part
                    found += [(a.name, node.lineno) for a in node.names]
                    continue
            elif node.module and node.module.startswith("mambakit."):
                name = node.module[len("mambakit.") :]
            else:
                continue
            found.append((name, node.lineno))
    return found


def test_every_import_goes_to_the_same_rank_or_below():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        src = part(".".join(path.relative_to(ROOT).with_suffix("").parts))
        assert src in RANKS, f"{path}: a part the rank table does not know ({src})"
        for name, line in imports(path):
            dst = part(name)
            assert dst in RANKS, f"{path}:{line}: imports {name}, not in the rank table"
            if RANKS[dst] > RANKS[src]:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({src}) imports {name} ({dst})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_walk_sees_relative_and_lazy_imports():
    """The walk is not vacuous: it finds model.py's import of the layers and a lazy import
    inside a function (ops dispatching to a Triton body)."""
    model = imports(ROOT / "model.py")
    assert any(name.startswith("layers.") for name, _ in model)
    ops = imports(ROOT / "ops" / "__init__.py")
    assert any(name == "ops.causal_conv1d" for name, _ in ops)
